"""4-bit projections of a few rows (a verify round's tokens) on tensor cores, one launch per input.

MLX's CUDA build multiplies a 4-bit projection by a few rows one row at a time: each row of x
reads the packed weights again. On an H200 an 8B-shaped 4-bit model's forward of 2, 4 and 6
tokens cost 1.57, 2.71 and 3.93 one-token forwards, and a 7B-shaped one's verify rounds took
21 ms for 7.5 tokens where the bf16 model's took 11: what 4-bit speculation gains, its verify
forwards spend. Here the projections of one input (q, k, v; gate, up) take one launch that
reads each packed weight once for up to `MAX_ROWS` rows of x.

The kernel is `mma_cuda`'s with W's fragments unpacked from MLX's affine 4-bit layout (eight
values a 32-bit word, the first in the low bits; a scale and an offset per `group_size` values
of a row). A nibble q becomes the 2-byte float `OFFSET + q` by or-ing it into the mantissa of
`OFFSET` (128 in bf16, 1024 in fp16: exact, no conversion instruction), and the mmas sum
x (OFFSET + q) over a piece of K that lies in one group. Each piece's sums then take the
group's scale and offset in float32: y += s (sum x (OFFSET + q)) + (o - OFFSET s) sum x, with
sum x the piece's sum of x's row, reduced across the four lanes that hold it. A lane holds
`piece_words` words of a W row (two, 16 values, for group sizes of 64 or more), so the four
lanes of a row read 32 contiguous bytes of it. On an H100 the 7B-shaped 4-bit target's
forwards of 2-8 tokens then cost 0.95-0.98 of a one-token forward (16 tokens: 1.13).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.mma_cuda import TILE_SOURCE, gather_source, mma_instruction, pick_source

__all__ = ["MAX_ROWS", "fits", "flat_matmul", "matmul", "parts_of", "serves"]

MAX_ROWS = 32  # rows of x (batch rows x tokens) one launch takes, in tiles of the mma's n (8)
WARPS = 8  # warps of a block, splitting K
BITS = 4
GROUP_SIZES = (32, 64, 128)
# a 2-byte float's bits for OFFSET (high and low half), OFFSET, and the mma's type
_FLOATS = {mx.bfloat16: ("0x43004300u", 128.0, "bf16"), mx.float16: ("0x64006400u", 1024.0, "f16")}
_kernels: dict[tuple[int, bool, Any], Any] = {}
# W tiles of 16 rows per warp by tiles of x: one at every tile count, the fastest of those
# timed on an H100 (28 7B-shaped 4-bit blocks' projections, `bench/qmatmul.py`, ms a
# pipelined step of 1 / 2 / 8 / 16 / 32 tokens): 1 W tile 3.17 / 3.25 / 3.49 / 4.94 / 6.94;
# 2 W tiles 4.28 / 4.29 / 4.41 / 5.19 / 7.83; 4 W tiles 5.88-8.44; MLX's 4.76 / 8.29 / 15.57 /
# 15.84 / 22.27
SHAPES = {1: 1, 2: 1, 3: 1, 4: 1}

Quantized = tuple[mx.array, mx.array, mx.array]  # packed weight (N, K / 8), scales, offsets


def piece_words(group_size: int) -> int:
    """Words of a W row a lane holds per step: a piece of 4 lanes x 8 x words values of K,
    within one group."""
    return min(group_size, 64) // 32


def serves(weight: mx.array, scales: mx.array, group_size: int, bits: int) -> bool:
    """Whether the kernel takes a projection quantized by MLX (affine; packed `weight`
    (N, K / 8), `scales` (N, K / group)): 4 bits, a group size of `GROUP_SIZES`, 2-byte float
    scales."""
    return (
        bits == BITS
        and group_size in GROUP_SIZES
        and scales.dtype in _FLOATS
        and weight.dtype == mx.uint32
        and (weight.shape[1] * 8) % group_size == 0
    )


def fits(x: mx.array, weight: mx.array, scales: mx.array, group_size: int, bits: int) -> bool:
    """Whether the kernel takes input x (rows, tokens, K) against a projection it `serves`:
    up to `MAX_ROWS` rows x tokens, in the scales' dtype."""
    return (
        x.ndim == 3
        and x.shape[0] * x.shape[1] <= MAX_ROWS
        and x.dtype == scales.dtype
        and x.shape[2] == weight.shape[1] * 8
        and serves(weight, scales, group_size, bits)
    )


def _source(count: int, bias: bool, dtype: mx.Dtype) -> str:
    magic, offset, ptx = _FLOATS[dtype]
    pick = pick_source(
        count,
        lambda i: (
            f"w = w{i}; sc = scales{i}; of = offsets{i}; y = y{i};"
            + (f" bias = bias{i};" if bias else "")
        ),
    )
    mma = mma_instruction(ptx)
    return f"""
    const int M = x_shape[0] * x_shape[1];
    const int K = x_shape[2];
    const int KW = K / 8, KG = K / G;  // a W row's words and groups
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    int b = blockIdx.x, g = -1, N = 0;
    const uint32_t* w = nullptr;
    const T* sc = nullptr;
    const T* of = nullptr;
    T* y = nullptr;{" const T* bias = nullptr;" if bias else ""}{pick}
    if (g < 0) return;
    const int n0 = b * 16 * WT;
    const uint32_t* wlo[WT];
    const uint32_t* whi[WT];
    const T* slo[WT];
    const T* shi[WT];
    const T* olo[WT];
    const T* ohi[WT];
    bool lo_ok[WT], hi_ok[WT];
    #pragma unroll
    for (int v = 0; v < WT; ++v) {{
        const int n = n0 + v * 16 + gid;
        lo_ok[v] = n < N;
        hi_ok[v] = n + 8 < N;
        const size_t lo = lo_ok[v] ? n : 0, hi = hi_ok[v] ? n + 8 : 0;
        wlo[v] = w + lo * KW;
        whi[v] = w + hi * KW;
        slo[v] = sc + lo * KG;
        shi[v] = sc + hi * KG;
        olo[v] = of + lo * KG;
        ohi[v] = of + hi * KG;
    }}
{TILE_SOURCE}    constexpr int PIECE = 32 * P;  // values of K a warp takes a step: 4 lanes x 8 x P
    for (int k0 = warp * PIECE; k0 < K; k0 += WARPS * PIECE) {{
        const int k = k0 + tig * 8 * P;  // this lane's first
        const int group = k0 / G;
        uint4 bx[P][TILES];
        float xs0[TILES], xs1[TILES];  // the piece's sums of x rows 2 tig and 2 tig + 1
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {{
            float s = 0.0f;
            #pragma unroll
            for (int p = 0; p < P; ++p) {{
                bx[p][t] = x_ok[t]
                    ? *reinterpret_cast<const uint4*>(xr + (size_t)t * 8 * K + k + 8 * p) : zero;
                const T* e = reinterpret_cast<const T*>(&bx[p][t]);
                #pragma unroll
                for (int i = 0; i < 8; ++i) s += static_cast<float>(e[i]);
            }}
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);  // x row t * 8 + gid's, in all 4 lanes
            xs0[t] = __shfl_sync(0xffffffffu, s, tig * 8);
            xs1[t] = __shfl_sync(0xffffffffu, s, tig * 8 + 4);
        }}
        #pragma unroll
        for (int v = 0; v < WT; ++v) {{
            uint32_t alo[P][4], ahi[P][4];  // OFFSET + q, two values a register
            #pragma unroll
            for (int p = 0; p < P; ++p) {{
                const uint32_t ql = lo_ok[v] ? wlo[v][k / 8 + p] : 0u;
                const uint32_t qh = hi_ok[v] ? whi[v][k / 8 + p] : 0u;
                alo[p][0] = {magic} | (ql & 0xFu) | ((ql << 12) & 0xF0000u);
                alo[p][1] = {magic} | ((ql >> 8) & 0xFu) | ((ql << 4) & 0xF0000u);
                alo[p][2] = {magic} | ((ql >> 16) & 0xFu) | ((ql >> 4) & 0xF0000u);
                alo[p][3] = {magic} | ((ql >> 24) & 0xFu) | ((ql >> 12) & 0xF0000u);
                ahi[p][0] = {magic} | (qh & 0xFu) | ((qh << 12) & 0xF0000u);
                ahi[p][1] = {magic} | ((qh >> 8) & 0xFu) | ((qh << 4) & 0xF0000u);
                ahi[p][2] = {magic} | ((qh >> 16) & 0xFu) | ((qh >> 4) & 0xF0000u);
                ahi[p][3] = {magic} | ((qh >> 24) & 0xFu) | ((qh >> 12) & 0xF0000u);
            }}
            const float sl = lo_ok[v] ? static_cast<float>(slo[v][group]) : 0.0f;
            const float sh = hi_ok[v] ? static_cast<float>(shi[v][group]) : 0.0f;
            const float ol = (lo_ok[v] ? static_cast<float>(olo[v][group]) : 0.0f) - {offset}f * sl;
            const float oh = (hi_ok[v] ? static_cast<float>(ohi[v][group]) : 0.0f) - {offset}f * sh;
            #pragma unroll
            for (int t = 0; t < TILES; ++t) {{
                float r[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
                #pragma unroll
                for (int p = 0; p < P; ++p) {{
                    asm volatile("{mma}"
                        : "+f"(r[0]), "+f"(r[1]), "+f"(r[2]), "+f"(r[3])
                        : "r"(alo[p][0]), "r"(ahi[p][0]), "r"(alo[p][1]), "r"(ahi[p][1]),
                          "r"(bx[p][t].x), "r"(bx[p][t].y));
                    asm volatile("{mma}"
                        : "+f"(r[0]), "+f"(r[1]), "+f"(r[2]), "+f"(r[3])
                        : "r"(alo[p][2]), "r"(ahi[p][2]), "r"(alo[p][3]), "r"(ahi[p][3]),
                          "r"(bx[p][t].z), "r"(bx[p][t].w));
                }}
                c[v][t][0] += sl * r[0] + ol * xs0[t];
                c[v][t][1] += sl * r[1] + ol * xs1[t];
                c[v][t][2] += sh * r[2] + oh * xs0[t];
                c[v][t][3] += sh * r[3] + oh * xs1[t];
            }}
        }}
    }}
""" + gather_source(bias)


def _kernel(count: int, bias: bool, dtype: mx.Dtype) -> Any:
    key = (count, bias, dtype)
    if key not in _kernels:
        names = [
            [f"w{i}", f"scales{i}", f"offsets{i}", *((f"bias{i}",) if bias else ())]
            for i in range(count)
        ]
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlxd_qmma{count}{'_bias' if bias else ''}_{_FLOATS[dtype][2]}",
            input_names=["x", *(n for part in names for n in part)],
            output_names=[f"y{i}" for i in range(count)],
            source=_source(count, bias, dtype),
        )
    return _kernels[key]


def template(
    x: mx.array, group_size: int, warps: int = WARPS, wt: int | None = None
) -> list[tuple[str, Any]]:
    """The kernel's template arguments for input x (`wt`: W tiles a warp, in place of
    `SHAPES`')."""
    tiles = -(-x.shape[0] * x.shape[1] // 8)
    return [
        ("T", x.dtype), ("WARPS", warps), ("TILES", tiles), ("WT", wt or SHAPES[tiles]),
        ("P", piece_words(group_size)), ("G", group_size),
    ]  # fmt: skip


def blocks_for(x: mx.array, weights: Sequence[mx.array], wt: int | None = None) -> int:
    """Blocks of a launch: 16 x `wt` rows of W each."""
    if wt is None:
        wt = SHAPES[-(-x.shape[0] * x.shape[1] // 8)]
    return sum(-(-w.shape[0] // (16 * wt)) for w in weights)


def flat_matmul(
    x: mx.array,
    *flat: mx.array,
    bias: bool,
    group_size: int,
    warps: int = WARPS,
    wt: int | None = None,
) -> list[mx.array]:
    """`matmul` on flat arguments, each packed weight followed by its scales and offsets (and
    its bias where `bias`): uncompiled, for callers that trace it into their own `mx.compile`."""
    width = 3 + bias
    weights = flat[::width]
    blocks = blocks_for(x, weights, wt)
    ys = _kernel(len(weights), bias, x.dtype)(
        inputs=[x, *flat],
        template=template(x, group_size, warps, wt),
        grid=(blocks * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], w.shape[0]) for w in weights],
        output_dtypes=[x.dtype] * len(weights),
    )  # fmt: skip
    return list(ys)


# Traced once per shape: a step replays the launch without building it in Python again.
_compiled: dict[tuple[bool, int], Any] = {}


def matmul(
    x: mx.array,
    weights: Sequence[Quantized],
    biases: Sequence[mx.array] | None = None,
    group_size: int = 64,
) -> list[mx.array]:
    """x W_i^T (+ bias_i) for the 4-bit weights W_i (N_i, K) of one input x (rows, tokens, K),
    each (packed, scales, offsets) as `nn.QuantizedLinear` holds them and `fits` x: one launch."""
    bias = biases is not None
    key = (bias, group_size)
    if key not in _compiled:
        _compiled[key] = mx.compile(partial(flat_matmul, bias=bias, group_size=group_size))
    flat: list[mx.array] = []
    for i, parts in enumerate(weights):
        flat.extend(parts)
        if biases is not None:
            flat.append(biases[i])
    return list(_compiled[key](x, *flat))


def parts_of(layer: nn.QuantizedLinear) -> Quantized:
    """A quantized projection's arrays as the kernel takes them."""
    return layer.weight, layer.scales, layer["biases"]
