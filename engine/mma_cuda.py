"""Matmuls of a few rows (a decoding batch's step) on tensor cores, one launch per input.

MLX's CUDA matmul sends 2-8 rows to cuBLAS, and every call builds its cublasLt descriptors and
asks for an algorithm anew: host work a decode step pays once per projection, where a lone
row's gemv pays none. Here the projections of one input (q, k, v; gate, up) take one kernel:
y_i = x W_i^T (+ bias_i). An H200, 8 rows through the 28 blocks of a 7B-shaped bf16 model's
projections (`bench/decode_matmul.py`): 4.57 ms per pipelined step against cuBLAS's 5.25, the
host's share 1.70 ms against 4.73; a lone row stays on MLX's gemv (3.89 ms; this kernel 4.42).

Each block takes 16 output columns of one projection; its warps split K and each issues
`mma.sync.m16n8k16` with 16 rows of W as A (16 x 16) and x's rows, up to 8, as B (16 x 8).
The order of the products inside a dot product is free, so a lane loads 16 contiguous bytes
of its two W rows and of its x row, and the 8 values feed two mmas, each taking the k pairs
the fragment layout gives that lane: W and x are read in full 16-byte pieces and straight into
the fragments, without shared memory. The warps' partial sums meet in shared memory once.
Accumulation is in float32, as cuBLAS's for bf16 and fp16.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx

__all__ = ["MAX_ROWS", "fits", "flat_matmul", "matmul"]

MAX_ROWS = 8  # the mma's n: rows of x (batch rows x tokens) one launch takes
WARPS = 8  # warps of a block, splitting K
UNROLL = 2  # 32-wide pieces of K a warp has in flight per step
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


def _source(count: int, bias: bool, ptx: str) -> str:
    pick = "".join(
        f"""
    if (g < 0) {{
        const int blocks = (w{i}_shape[0] + 15) / 16;
        if (b < blocks) {{
            g = {i}; N = w{i}_shape[0]; w = w{i}; y = y{i};{f" bias = bias{i};" if bias else ""}
        }} else {{
            b -= blocks;
        }}
    }}"""
        for i in range(count)
    )
    add_bias = "v += static_cast<float>(bias[n]);" if bias else ""
    mma = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    )
    return f"""
    const int M = x_shape[0] * x_shape[1];
    const int K = x_shape[2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    int b = blockIdx.x, g = -1, N = 0;
    const T* w = nullptr;
    T* y = nullptr;{" const T* bias = nullptr;" if bias else ""}{pick}
    if (g < 0) return;
    const int n0 = b * 16;
    const bool lo_ok = n0 + gid < N, hi_ok = n0 + gid + 8 < N, x_ok = gid < M;
    const T* wlo = w + (size_t)(lo_ok ? n0 + gid : 0) * K;
    const T* whi = w + (size_t)(hi_ok ? n0 + gid + 8 : 0) * K;
    const T* xr = x + (size_t)(x_ok ? gid : 0) * K;
    float c[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int k0 = warp * 32 * U; k0 < K; k0 += WARPS * 32 * U) {{
        uint4 alo[U], ahi[U], bx[U];
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            const int k = k0 + u * 32 + tig * 8;
            const bool in = k < K;
            alo[u] = in && lo_ok ? *reinterpret_cast<const uint4*>(wlo + k) : zero;
            ahi[u] = in && hi_ok ? *reinterpret_cast<const uint4*>(whi + k) : zero;
            bx[u] = in && x_ok ? *reinterpret_cast<const uint4*>(xr + k) : zero;
        }}
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            asm volatile("{mma}"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(alo[u].x), "r"(ahi[u].x), "r"(alo[u].y), "r"(ahi[u].y),
                  "r"(bx[u].x), "r"(bx[u].y));
            asm volatile("{mma}"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(alo[u].z), "r"(ahi[u].z), "r"(alo[u].w), "r"(ahi[u].w),
                  "r"(bx[u].z), "r"(bx[u].w));
        }}
    }}
    __shared__ float partial[WARPS][32][4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][i] = c[i];
    __syncthreads();
    if (warp != 0) return;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {{
        float v = 0.0f;
        #pragma unroll
        for (int j = 0; j < WARPS; ++j) v += partial[j][lane][i];
        const int m = tig * 2 + (i & 1), n = n0 + gid + (i >> 1) * 8;
        if (m < M && n < N) {{
            {add_bias}
            y[(size_t)m * N + n] = static_cast<T>(v);
        }}
    }}
"""


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


def flat_matmul(x: mx.array, *flat: mx.array, bias: bool) -> list[mx.array]:
    """`matmul` on flat arguments, each weight followed by its bias where `bias`: uncompiled,
    for callers that trace it into their own `mx.compile`."""
    width = 1 + bias
    weights = flat[::width]
    blocks = sum(-(-w.shape[0] // 16) for w in weights)
    ys = _kernel(len(weights), bias, x.dtype)(
        inputs=[x, *flat],
        template=[("T", x.dtype), ("WARPS", WARPS), ("U", UNROLL)],
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
