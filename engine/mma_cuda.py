"""Matmuls of a few rows (a decoding batch's step) on tensor cores, one launch per input.

MLX's CUDA matmul sends 2-8 rows to cuBLAS, and every call builds its cublasLt descriptors and
asks for an algorithm anew: host work a decode step pays once per projection, where a lone
row's gemv pays none. Here the projections of one input (q, k, v; gate, up) take one kernel:
y_i = x W_i^T (+ bias_i). An H200, 8 rows through the 28 blocks of a 7B-shaped bf16 model's
projections (`bench/decode_matmul.py`): 4.57 ms per pipelined step against cuBLAS's 5.25, the
host's share 1.70 ms against 4.73; a lone row stays on MLX's gemv (3.89 ms; this kernel 4.42).

Each block takes 16 output columns of one projection; its warps split K and each issues
`mma.sync.m16n8k16` with 16 rows of W as A (16 x 16) and x's rows, 8 at a time, as B (16 x 8):
W's fragments are loaded once for every tile of 8 rows, up to 32 (a verify round's rows x
tokens, which cuBLAS would also take, with its descriptors and algorithm query per call).
Every block reads all of x, so past 8 rows a warp takes two tiles of W (`SHAPES`); past 32,
x's traffic makes the kernel slower than cuBLAS even counting cuBLAS's host time.
The order of the products inside a dot product is free, so a lane loads 16 contiguous bytes
of its two W rows and of its x row, and the 8 values feed two mmas, each taking the k pairs
the fragment layout gives that lane: W and x are read in full 16-byte pieces and straight into
the fragments, without shared memory. The warps' partial sums meet in shared memory once.
Accumulation is in float32, as cuBLAS's for bf16 and fp16.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import mlx.core as mx

__all__ = ["MAX_ROWS", "fits", "flat_matmul", "matmul"]

MAX_ROWS = 32  # rows of x (batch rows x tokens) one launch takes, in tiles of the mma's n (8)
WARPS = 8  # warps of a block, splitting K
_PTX = {mx.bfloat16: "bf16", mx.float16: "f16"}
_kernels: dict[tuple[int, bool, Any], Any] = {}


def fits(x: mx.array, weight: mx.array) -> bool:
    """Whether the kernel takes input x (rows, tokens, K) against `weight` (N, K): up to 8
    rows x tokens, a 2-byte float dtype shared by both, K in 16-byte pieces."""
    return (
        x.ndim == 3
        and x.shape[0] * x.shape[1] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in _PTX
        and x.shape[2] % 8 == 0
    )


def pick_source(count: int, assign: Callable[[int], str]) -> str:
    """Kernel source that finds the projection g (of `count`, each 16 x WT rows of W `w{g}` a
    block) and block b within it that this block computes; `assign(i)` sets its pointers."""
    return "".join(
        f"""
    if (g < 0) {{
        const int blocks = (w{i}_shape[0] + 16 * WT - 1) / (16 * WT);
        if (b < blocks) {{
            g = {i}; N = w{i}_shape[0]; {assign(i)}
        }} else {{
            b -= blocks;
        }}
    }}"""
        for i in range(count)
    )


def mma_instruction(ptx: str) -> str:
    """m16n8k16 on 2-byte floats `ptx` into float32 sums: operands c[4], a[4], b[2]."""
    return (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    )


# Kernel source: this lane's row of x (`xr`), which tiles of x it holds rows of (`x_ok`), and
# its partial outputs `c[WT][TILES][4]`, zeroed
TILE_SOURCE = """    const T* xr = x + (size_t)gid * K;
    bool x_ok[TILES];
    #pragma unroll
    for (int t = 0; t < TILES; ++t) x_ok[t] = t * 8 + gid < M;
    float c[WT][TILES][4];
    #pragma unroll
    for (int v = 0; v < WT; ++v) {
        #pragma unroll
        for (int t = 0; t < TILES; ++t) c[v][t][0] = c[v][t][1] = c[v][t][2] = c[v][t][3] = 0.0f;
    }
    const uint4 zero = make_uint4(0, 0, 0, 0);
"""


def gather_source(bias: bool) -> str:
    """Kernel source that sums the warps' partial outputs `c[WT][TILES][4]` (split K) and
    writes y (M x N), adding `bias[n]` where `bias`."""
    add_bias = "s += static_cast<float>(bias[n]);" if bias else ""
    return f"""
    constexpr int OUT = WT * TILES * 4;  // a lane's sums
    __shared__ float partial[WARPS][32][OUT];
    #pragma unroll
    for (int v = 0; v < WT; ++v) {{
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {{
            #pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][lane][(v * TILES + t) * 4 + i] = c[v][t][i];
        }}
    }}
    __syncthreads();
    // the warps' sums of each output, spread over all the block's threads
    for (int o = threadIdx.x; o < 32 * OUT; o += WARPS * 32) {{
        const int l = o / OUT, r = o % OUT;
        const int v = r / (TILES * 4), t = (r / 4) % TILES, i = r % 4;
        float s = 0.0f;
        #pragma unroll
        for (int j = 0; j < WARPS; ++j) s += partial[j][l][r];
        const int m = t * 8 + (l % 4) * 2 + (i & 1), n = n0 + v * 16 + l / 4 + (i >> 1) * 8;
        if (m < M && n < N) {{
            {add_bias}
            y[(size_t)m * N + n] = static_cast<T>(s);
        }}
    }}
"""


def _source(count: int, bias: bool, ptx: str) -> str:
    pick = pick_source(count, lambda i: f"w = w{i}; y = y{i};{f' bias = bias{i};' if bias else ''}")
    mma = mma_instruction(ptx)
    return f"""
    const int M = x_shape[0] * x_shape[1];
    const int K = x_shape[2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    int b = blockIdx.x, g = -1, N = 0;
    const T* w = nullptr;
    T* y = nullptr;{" const T* bias = nullptr;" if bias else ""}{pick}
    if (g < 0) return;
    const int n0 = b * 16 * WT;
    const T* wlo[WT];
    const T* whi[WT];
    bool lo_ok[WT], hi_ok[WT];
    #pragma unroll
    for (int v = 0; v < WT; ++v) {{
        const int n = n0 + v * 16 + gid;
        lo_ok[v] = n < N;
        hi_ok[v] = n + 8 < N;
        wlo[v] = w + (size_t)(lo_ok[v] ? n : 0) * K;
        whi[v] = w + (size_t)(hi_ok[v] ? n + 8 : 0) * K;
    }}
{TILE_SOURCE}    for (int k0 = warp * 32 * U; k0 < K; k0 += WARPS * 32 * U) {{
        uint4 alo[U][WT], ahi[U][WT], bx[U][TILES];
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            const int k = k0 + u * 32 + tig * 8;
            const bool in = k < K;
            #pragma unroll
            for (int v = 0; v < WT; ++v) {{
                alo[u][v] = in && lo_ok[v] ? *reinterpret_cast<const uint4*>(wlo[v] + k) : zero;
                ahi[u][v] = in && hi_ok[v] ? *reinterpret_cast<const uint4*>(whi[v] + k) : zero;
            }}
            #pragma unroll
            for (int t = 0; t < TILES; ++t) {{
                const size_t at = (size_t)t * 8 * K + k;
                bx[u][t] = in && x_ok[t] ? *reinterpret_cast<const uint4*>(xr + at) : zero;
            }}
        }}
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            #pragma unroll
            for (int v = 0; v < WT; ++v) {{
                #pragma unroll
                for (int t = 0; t < TILES; ++t) {{
                    asm volatile("{mma}"
                        : "+f"(c[v][t][0]), "+f"(c[v][t][1]), "+f"(c[v][t][2]), "+f"(c[v][t][3])
                        : "r"(alo[u][v].x), "r"(ahi[u][v].x), "r"(alo[u][v].y), "r"(ahi[u][v].y),
                          "r"(bx[u][t].x), "r"(bx[u][t].y));
                    asm volatile("{mma}"
                        : "+f"(c[v][t][0]), "+f"(c[v][t][1]), "+f"(c[v][t][2]), "+f"(c[v][t][3])
                        : "r"(alo[u][v].z), "r"(ahi[u][v].z), "r"(alo[u][v].w), "r"(ahi[u][v].w),
                          "r"(bx[u][t].z), "r"(bx[u][t].w));
                }}
            }}
        }}
    }}
""" + gather_source(bias)


def _kernel(count: int, bias: bool, dtype: mx.Dtype) -> Any:
    key = (count, bias, dtype)
    if key not in _kernels:
        names = [[f"w{i}", *((f"bias{i}",) if bias else ())] for i in range(count)]
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlxd_mma{count}{'_bias' if bias else ''}_{_PTX[dtype]}",
            input_names=["x", *(n for part in names for n in part)],
            output_names=[f"y{i}" for i in range(count)],
            source=_source(count, bias, _PTX[dtype]),
        )
    return _kernels[key]


# (unroll, W tiles) by tiles of x, the fastest of those timed on an H200 (28 7B-shaped bf16
# blocks' projections, `bench/decode_matmul.py`, ms a pipelined step): 8 rows 4.55 (U 2, 1 W
# tile); 16 rows 5.61 (U 1, 1; 6.20 with U 2 and 2 W tiles); 24 rows 6.29 (U 1, 2 W tiles: x,
# read again by every block, outweighs W past a tile of it); 32 rows 6.88 (U 2, 2; 10.31 with
# U 1 and 2 W tiles). cuBLAS took 5.37, 5.39, 5.66 and 4.50, its host 3.6-5.2 of them.
SHAPES = {1: (2, 1), 2: (1, 1), 3: (1, 2), 4: (2, 2)}


def shape_for(rows: int) -> tuple[int, int, int]:
    """(tiles, unroll, W tiles) for `rows` rows of x: 8 rows a tile, each tile's mmas taking
    one W fragment loaded for all of them; `unroll` pieces of K in flight per warp and step;
    `W tiles` of 16 rows of W per warp, so a block reads x once for 16 x W tiles rows of W."""
    tiles = -(-rows // 8)
    return (tiles, *SHAPES[tiles])


def template(
    x: mx.array, warps: int, shape: tuple[int, int, int] | None = None
) -> list[tuple[str, Any]]:
    """The kernel's template arguments for input x (`shape`: (tiles, unroll, W tiles) in
    place of `shape_for`'s)."""
    tiles, unroll, wt = shape or shape_for(x.shape[0] * x.shape[1])
    return [("T", x.dtype), ("WARPS", warps), ("U", unroll), ("TILES", tiles), ("WT", wt)]


def blocks_for(x: mx.array, weights: Sequence[mx.array], wt: int | None = None) -> int:
    """Blocks of a launch: 16 x `wt` rows of W each (`shape_for`'s W tiles)."""
    if wt is None:
        wt = shape_for(x.shape[0] * x.shape[1])[2]
    return sum(-(-w.shape[0] // (16 * wt)) for w in weights)


def flat_matmul(x: mx.array, *flat: mx.array, bias: bool) -> list[mx.array]:
    """`matmul` on flat arguments, each weight followed by its bias where `bias`: uncompiled,
    for callers that trace it into their own `mx.compile`."""
    width = 1 + bias
    weights = flat[::width]
    blocks = blocks_for(x, weights)
    ys = _kernel(len(weights), bias, x.dtype)(
        inputs=[x, *flat],
        template=template(x, WARPS),
        grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], w.shape[0]) for w in weights],
        output_dtypes=[x.dtype] * len(weights),
    )  # fmt: skip
    return list(ys)


# Traced once per shape: a step replays the launch without building it in Python again.
_compiled = {bias: mx.compile(partial(flat_matmul, bias=bias)) for bias in (False, True)}


def matmul(
    x: mx.array, weights: Sequence[mx.array], biases: Sequence[mx.array] | None = None
) -> list[mx.array]:
    """x W_i^T (+ bias_i) for the weights W_i (N_i, K) of one input x (rows, tokens, K),
    which `fits` each of them: one launch."""
    if biases is None:
        return _compiled[False](x, *weights)
    flat = [a for pair in zip(weights, biases, strict=True) for a in pair]
    return _compiled[True](x, *flat)
