"""LoRA projections for decoding on MLX's CUDA build: the base matmul and the term in few kernels.

Decoding multiplies a few rows by each weight, so a projection is one memory-bound pass over W
and a low-rank term is nothing but its kernel launches. On an H200 MLX's CUDA backend spends
6-8 us of host time encoding each op into a CUDA graph (a cuBLAS matmul of 2-8 rows: 20-39 us;
`engine.backend` turns the graphs off, which served adapted rows faster), more than the GPU
spends on any of a 7B block's small ones, so a decode step costs what its op count costs the
host. The term as MLX ops (two gathered matmuls and an add per projection) cost a lone row
30-45 % of its step. Here a call for up to three projections of one input (q, k, v; gate, up)
launches two kernels:

- `down`: h_i = x A_i[slot] for every row and projection, one block per (row, rank index),
  each reducing K with 256 threads in float32;
- `project`: y_i = x W_i^T + h_i sB_i[slot]^T (+ bias_i) for all of them: a warp takes C
  neighbouring output columns of one projection (every row of x it loads multiplies all C),
  each lane U 16-byte pieces of W per step; the term is added in the epilogue.

So a lone row's block of seven adapted projections launches 8 kernels where the base launches
7. Several adapted rows (a batch) take `mma_cuda`'s tensor-core kernel for x W_i^T instead (MLX's
matmul where it is off), then a `down` and an `up` launch per group (h = x A[slot] once per row
and rank, then y + h sB^T): with 8 rows `project` reads W at about half cuBLAS's speed, which a
batch's device-bound step pays in full. An H200, 16 blocks of a 7B-shaped bf16 model, every
projection adapted (`bench/lora_kernels.py`), 8 rows: 1.25x the base's step this way with the
tensor-core base, 1.88x with one `term` launch per group instead (each of its blocks reduces
its row's x A again; with cuBLAS for the base it had measured 1.33x against down and up's
1.62x, so the two were timed again with the tensor-core base) and 3.15x through `project`. A
lone row through `project`: 1.15x, where the project kernel alone (no terms) reads W as fast as
MLX's gemv (0.98x); it had been 1.64x with the row's slot index (idx) in MLX's CUDA pool of
arrays of 8 bytes or less, which `engine.smallarrays` keeps it out of. Rows on the base can take
the kernels too, one launch for q, k and v (`pays`). A call is traced by `mx.compile`, so a
step replays it without building its kernels' calls in Python.
Forwards of more rows x tokens than the kernels take (`fits`: 8; rows on the base alone, the
tensor-core kernel's 32, a verify round's) and prompts are left to the MLX ops. The kernels
read K in 16-byte pieces: K a multiple of 8 and a 2-byte dtype (bf16, fp16), which `serves`
checks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, NamedTuple

import mlx.core as mx

from mlxd.engine import mma_cuda
from mlxd.engine.smallarrays import kernel_array

__all__ = [
    "MAX_ROWS", "Part", "batches_take_kernels", "bound", "fits", "pays", "project", "queued",
    "serves", "takes_terms", "terms_call", "warm",
]  # fmt: skip

MAX_ROWS = 8  # rows of x (batch rows x tokens) the kernels take; more take the MLX ops
MATMUL_ROWS = 2  # adapted rows x tokens from which the base takes a matmul (see `_project`)
THREADS = 256
DOWN_PIECES = 4  # 16-byte pieces of x and of A a `down` thread has in flight (K = 18,944: 3 waits)
WARPS = THREADS // 32


# v += h[m] . sB[slot][n] for output n of row m, 8 ranks a step: B's row and h's in three
# vector loads in flight at once (ranks the stacks' multiple of 8), not R dependent scalar
# loads (with DOWN_PIECES: 8 rows 1.19x the base's step against 1.25x, a lone row unchanged)
_TERM = """
            const T* br = bt + ((size_t)(s - 1) * N + n) * R;
            const float* hr = h + (size_t)m * R;
            for (int j = 0; j < R; j += 8) {
                const uint4 bv = *reinterpret_cast<const uint4*>(br + j);
                const float4 h0 = *reinterpret_cast<const float4*>(hr + j);
                const float4 h1 = *reinterpret_cast<const float4*>(hr + j + 4);
                const T* bp = reinterpret_cast<const T*>(&bv);
                v += h0.x * static_cast<float>(bp[0]) + h0.y * static_cast<float>(bp[1])
                   + h0.z * static_cast<float>(bp[2]) + h0.w * static_cast<float>(bp[3])
                   + h1.x * static_cast<float>(bp[4]) + h1.y * static_cast<float>(bp[5])
                   + h1.z * static_cast<float>(bp[6]) + h1.w * static_cast<float>(bp[7]);
            }"""


def _down_source(count: int) -> str:
    """h_i = x A_i[slot] for `count` projections of the same input (q, k, v; gate, up): one
    block per (row, rank index over them all), each reducing K with 256 threads in float32."""
    ranks = [f"at{i}_shape[1]" for i in range(count)]
    pick = "".join(
        f"""
    if (j >= first && j < first + {ranks[i]}) {{
        R = {ranks[i]}; jj = j - first; ar = at{i}; out = h{i};
    }}
    first += {ranks[i]};"""
        for i in range(count)
    )
    return f"""
    const int RH = {" + ".join(ranks)};
    const int K = x_shape[2];
    const int m = blockIdx.x / RH;
    const int j = blockIdx.x % RH;
    int first = 0, R = 0, jj = 0;
    const T* ar = nullptr;
    float* out = nullptr;{pick}
    const uint32_t s = idx[m];
    float acc = 0.0f;
    if (s != 0) {{
        const T* xr = x + (size_t)m * K;
        ar += ((size_t)(s - 1) * R + jj) * K;
        const int step = blockDim.x * 8;
        for (int k0 = threadIdx.x * 8; k0 < K; k0 += step * {DOWN_PIECES}) {{
            uint4 xv[{DOWN_PIECES}], av[{DOWN_PIECES}];
            #pragma unroll
            for (int u = 0; u < {DOWN_PIECES}; ++u) {{
                const int k = k0 + u * step;
                xv[u] = k < K ? *reinterpret_cast<const uint4*>(xr + k) : make_uint4(0, 0, 0, 0);
                av[u] = k < K ? *reinterpret_cast<const uint4*>(ar + k) : make_uint4(0, 0, 0, 0);
            }}
            #pragma unroll
            for (int u = 0; u < {DOWN_PIECES}; ++u) {{
                const T* xp = reinterpret_cast<const T*>(&xv[u]);
                const T* ap = reinterpret_cast<const T*>(&av[u]);
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc += static_cast<float>(xp[i]) * static_cast<float>(ap[i]);
            }}
        }}
    }}
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
    __shared__ float parts[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) parts[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {{
        float total = 0.0f;
        for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += parts[w];
        out[m * R + jj] = total;
    }}
"""


def _project_source(count: int, bias: bool, term: bool) -> str:
    """y_i = x W_i^T (+ h_i sB_i[slot]^T) (+ bias_i) for `count` projections of one input: each
    warp takes C neighbouring output columns of one projection, each lane U 16-byte pieces of
    each of their rows per step (C x U loads in flight), and every row of x it loads is
    multiplied against all C columns, so x is read C times less than column by column."""
    pick = "".join(
        f"""
    if (g < 0) {{
        const int blocks = (w{i}_shape[0] + per_block - 1) / per_block;
        if (b < blocks) {{
            g = {i}; N = w{i}_shape[0]; w = w{i}; y = y{i};{f" bias = bias{i};" if bias else ""}{
            f" R = bt{i}_shape[2]; bt = bt{i}; h = h{i};" if term else ""
        }
        }} else {{
            b -= blocks;
        }}
    }}"""
        for i in range(count)
    )
    add_bias = "v += static_cast<float>(bias[n]);" if bias else ""
    add_term = f"""
        const uint32_t s = idx[m];
        if (s != 0) {{{_TERM}
        }}"""
    return f"""
    static_assert(C * MAX_M <= 32, "a lane per (column, row) output");
    const int M = x_shape[0] * x_shape[1];
    const int K = x_shape[2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int per_block = (blockDim.x / 32) * C;
    int b = blockIdx.x, g = -1, N = 0;
    const T* w = nullptr;
    T* y = nullptr;{" const T* bias = nullptr;" if bias else ""}{
        " int R = 0; const T* bt = nullptr; const float* h = nullptr;" if term else ""
    }{pick}
    if (g < 0) return;
    const int n0 = b * per_block + warp * C;
    if (n0 >= N) return;
    float acc[C][MAX_M];
    #pragma unroll
    for (int c = 0; c < C; ++c) {{
        #pragma unroll
        for (int m = 0; m < MAX_M; ++m) acc[c][m] = 0.0f;
    }}
    for (int k0 = lane * 8; k0 < K; k0 += 256 * U) {{
        uint4 wv[U][C];
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            const int k = k0 + u * 256;
            #pragma unroll
            for (int c = 0; c < C; ++c) {{
                wv[u][c] = (k < K && n0 + c < N)
                    ? *reinterpret_cast<const uint4*>(w + (size_t)(n0 + c) * K + k)
                    : make_uint4(0, 0, 0, 0);
            }}
        }}
        #pragma unroll
        for (int u = 0; u < U; ++u) {{
            const int k = k0 + u * 256;
            if (k >= K) break;
            #pragma unroll
            for (int m = 0; m < MAX_M; ++m) {{
                if (m < M) {{
                    uint4 xv = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
                    const T* xp = reinterpret_cast<const T*>(&xv);
                    float xf[8];
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) xf[i] = static_cast<float>(xp[i]);
                    #pragma unroll
                    for (int c = 0; c < C; ++c) {{
                        const T* wp = reinterpret_cast<const T*>(&wv[u][c]);
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[c][m] += static_cast<float>(wp[i]) * xf[i];
                    }}
                }}
            }}
        }}
    }}
    float v = 0.0f;
    #pragma unroll
    for (int c = 0; c < C; ++c) {{
        #pragma unroll
        for (int m = 0; m < MAX_M; ++m) {{
            if (m < M) {{
                float a = acc[c][m];
                for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
                if (lane == c * MAX_M + m) v = a;
            }}
        }}
    }}
    const int c = lane / MAX_M, m = lane % MAX_M, n = n0 + c;
    if (c < C && m < M && n < N) {{{add_term if term else ""}
        {add_bias}
        y[(size_t)m * N + n] = static_cast<T>(v);
    }}
"""


def _up_source(count: int) -> str:
    """out_i = y_i + h_i sB_i[slot]^T for `count` projections' outputs y_i (M, N_i): a thread
    per output element, each adding its row's term (R products) to what MLX's matmul wrote."""
    pick = "".join(
        f"""
    if (y == nullptr) {{
        const size_t span = (size_t)M * y{i}_shape[2];
        if (t < span) {{
            N = y{i}_shape[2]; R = bt{i}_shape[2]; y = y{i}; h = h{i}; bt = bt{i}; out = out{i};
        }} else {{
            t -= span;
        }}
    }}"""
        for i in range(count)
    )
    return f"""
    const int M = idx_shape[0];
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int N = 0, R = 0;
    const T* y = nullptr;
    const float* h = nullptr;
    const T* bt = nullptr;
    T* out = nullptr;{pick}
    if (y == nullptr) return;
    const int m = t / N, n = t % N;
    float v = static_cast<float>(y[t]);
    const uint32_t s = idx[m];
    if (s != 0) {{{_TERM}
    }}
    out[t] = static_cast<T>(v);
"""


def _term_source(count: int, shared: bool) -> str:
    """out_i = y_i + (x A_i[slot]) sB_i[slot]^T for `count` projections' matmul outputs y_i
    (M, N_i), in one launch: a block per (row, TILE outputs of one projection) first reduces
    h = x A[slot] (R values; A's rows are read from L2 by each of the row's blocks) in one pass
    over K with every rank's loads in flight at once (rank by rank, a block waits out its
    loads' latency R times over, which a few blocks with K up to 18,944 cannot hide), then
    adds h sB^T to its outputs. A row of no adapter (idx 0) copies y. `shared`: the y_i are
    columns offsets[i].. of one output y (M, sum N_i) of a fused matmul (`engine.fusedproj`)."""
    source = "y + (size_t)m * y_shape[2] + offsets[{i}]" if shared else "y{i} + (size_t)m * N"
    pick = "".join(
        f"""
    if (g < 0) {{
        const int tiles = (bt{i}_shape[1] + TILE - 1) / TILE;
        if (b < tiles) {{
            g = {i}; N = bt{i}_shape[1]; R = at{i}_shape[1];
            yr = {source.format(i=i)}; at = at{i}; bt = bt{i}; out = out{i};
        }} else {{
            b -= tiles;
        }}
    }}"""
        for i in range(count)
    )
    tiles = " + ".join(f"(bt{i}_shape[1] + TILE - 1) / TILE" for i in range(count))
    return f"""
    const int K = x_shape[2];
    const int per_row = {tiles};
    const int m = blockIdx.x / per_row;
    int b = blockIdx.x % per_row, g = -1, N = 0, R = 0;
    const T* yr = nullptr;
    const T* at = nullptr;
    const T* bt = nullptr;
    T* out = nullptr;{pick}
    const int n0 = b * TILE;
    const int n1 = min(n0 + TILE, N);
    T* outr = out + (size_t)m * N;
    const uint32_t s = idx[m];
    if (s == 0) {{
        for (int n = n0 + threadIdx.x; n < n1; n += blockDim.x) outr[n] = yr[n];
        return;
    }}
    __shared__ float parts[(THREADS / 32) * MAX_R];
    __shared__ float h[MAX_R];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const T* xr = x + (size_t)m * K;
    const T* ar = at + (size_t)(s - 1) * R * K;
    float acc[MAX_R];
    #pragma unroll
    for (int j = 0; j < MAX_R; ++j) acc[j] = 0.0f;
    for (int k = threadIdx.x * 8; k < K; k += blockDim.x * 8) {{
        uint4 xv = *reinterpret_cast<const uint4*>(xr + k);
        const T* xp = reinterpret_cast<const T*>(&xv);
        float xf[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) xf[i] = static_cast<float>(xp[i]);
        #pragma unroll
        for (int j = 0; j < MAX_R; ++j) {{
            if (j < R) {{
                uint4 av = *reinterpret_cast<const uint4*>(ar + (size_t)j * K + k);
                const T* ap = reinterpret_cast<const T*>(&av);
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[j] += xf[i] * static_cast<float>(ap[i]);
            }}
        }}
    }}
    #pragma unroll
    for (int j = 0; j < MAX_R; ++j) {{
        if (j < R) {{
            float a = acc[j];
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
            if (lane == 0) parts[warp * MAX_R + j] = a;
        }}
    }}
    __syncthreads();
    if (threadIdx.x < R) {{
        float total = 0.0f;
        for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += parts[w * MAX_R + threadIdx.x];
        h[threadIdx.x] = total;
    }}
    __syncthreads();
    for (int n = n0 + threadIdx.x; n < n1; n += blockDim.x) {{
        float v = static_cast<float>(yr[n]);
        const T* br = bt + ((size_t)(s - 1) * N + n) * R;
        for (int j = 0; j < R; ++j) v += h[j] * static_cast<float>(br[j]);
        outr[n] = static_cast<T>(v);
    }}
"""


# (columns per warp C, 16-byte pieces in flight per column U) by the rows of x a kernel is built
# for: a lone row wants loads in flight; several rows want each x piece used on more columns
# (C x MAX_M <= 32: a lane writes each (column, row) output). A lone row over 16 7B-shaped
# blocks on an H200 (`bench/lora_kernels.py --shapes`, one start, idx then in MLX's scalar
# pool): 2 x 2 1.62x the base's step, 4 x 2 1.60x, 8 x 1 1.54x, 1 x 4 1.85x, 16 x 1 1.90x
SHAPES = {1: (2, 2), MAX_ROWS: (4, 1)}
FUSE_BYTES = 64 << 20  # base rows of a batch take the kernels for at most this much weight
_downs: dict[int, Any] = {}
_projects: dict[tuple[int, bool, bool], Any] = {}
_ups: dict[int, Any] = {}
_terms: dict[tuple[int, bool], Any] = {}
TERM_TILE = 2048  # outputs per block of the term kernel
MAX_TERM_RANK = 64  # ranks the term kernel takes (its shared memory); higher: down and up


class Part(NamedTuple):
    """One projection as the kernels read it: the base's and, adapted, every slot's term."""

    at: mx.array | None  # (adapters, r, K): each held adapter's A^T, r a multiple of 8
    weight: mx.array  # (N, K)
    bt: mx.array | None  # (adapters, N, r): each held adapter's (sB)^T
    bias: mx.array | None  # (N,)


def _down_kernel(count: int) -> Any:
    if count not in _downs:
        _downs[count] = mx.fast.cuda_kernel(
            name=f"mlxd_lora_down{count}",
            input_names=["x", *(f"at{i}" for i in range(count)), "idx"],
            output_names=[f"h{i}" for i in range(count)],
            source=_down_source(count),
        )
    return _downs[count]


def _project_kernel(count: int, bias: bool, term: bool) -> Any:
    key = (count, bias, term)
    if key not in _projects:
        names = [
            [f"w{i}", *((f"h{i}", f"bt{i}") if term else ()), *((f"bias{i}",) if bias else ())]
            for i in range(count)
        ]
        _projects[key] = mx.fast.cuda_kernel(
            name=f"mlxd_project{count}{'_bias' if bias else ''}{'_lora' if term else ''}",
            input_names=["x", *(["idx"] if term else []), *(n for part in names for n in part)],
            output_names=[f"y{i}" for i in range(count)],
            source=_project_source(count, bias, term),
        )
    return _projects[key]


def _up_kernel(count: int) -> Any:
    if count not in _ups:
        _ups[count] = mx.fast.cuda_kernel(
            name=f"mlxd_lora_up{count}",
            input_names=["idx", *(n for i in range(count) for n in (f"y{i}", f"h{i}", f"bt{i}"))],
            output_names=[f"out{i}" for i in range(count)],
            source=_up_source(count),
        )
    return _ups[count]


def _term_kernel(count: int, shared: bool = False) -> Any:
    key = (count, shared)
    if key not in _terms:
        lead = ["x", "idx", *(["y", "offsets"] if shared else [])]
        parts = [[*([] if shared else [f"y{i}"]), f"at{i}", f"bt{i}"] for i in range(count)]
        _terms[key] = mx.fast.cuda_kernel(
            name=f"mlxd_lora_term{count}{'_shared' if shared else ''}",
            input_names=[*lead, *(name for part in parts for name in part)],
            output_names=[f"out{i}" for i in range(count)],
            source=_term_source(count, shared),
        )
    return _terms[key]


def fits(x: mx.array, dtype: mx.Dtype, term: bool = True) -> bool:
    """Whether the kernels take input x (batch rows, tokens, K) of a projection in `dtype`:
    up to `MAX_ROWS` rows x tokens, and rows on the base alone (no `term`) up to the
    tensor-core kernel's."""
    most = mma_cuda.MAX_ROWS if not term and mma_on() else MAX_ROWS  # adapted: no env read
    return x.ndim == 3 and x.dtype == dtype and x.shape[0] * x.shape[1] <= most


def serves(weight: mx.array) -> bool:
    """Whether the kernels take this weight (N, K): a 2-byte float, K in 16-byte pieces."""
    return weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % 8 == 0


def _down(x: mx.array, idx: mx.array, ats: list[mx.array]) -> list[mx.array]:
    """h_i = x A_i[idx] in float32, (rows x tokens, r_i)."""
    rows = x.shape[0] * x.shape[1]
    width = sum(at.shape[1] for at in ats)
    hs = _down_kernel(len(ats))(
        inputs=[x, *ats, idx], template=[("T", x.dtype)],
        grid=(rows * width * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, at.shape[1]) for at in ats], output_dtypes=[mx.float32] * len(ats),
    )  # fmt: skip
    return list(hs)


def _project(
    x: mx.array,
    *flat: mx.array,
    bias: bool,
    term: bool,
    matmul_rows: int = MATMUL_ROWS,
    fused: bool = False,
    shape: tuple[int, int] | None = None,
) -> list[mx.array]:
    """`project` on flat arguments: (idx,) if term, then per part weight, (at, bt), (bias).
    From `matmul_rows` rows x tokens, adapted rows take `_matmul_then_terms` (`fused`); the
    project kernel takes `shape` (C, U) in place of SHAPES' (`bench/lora_kernels.py --shapes`)."""
    width = 1 + 2 * term + bias
    parts = [flat[i : i + width] for i in range(int(term), len(flat), width)]
    if term and x.shape[0] * x.shape[1] >= matmul_rows:
        return _matmul_then_terms(x, flat[0], parts, bias, fused)
    if not term and x.shape[0] * x.shape[1] > 1 and _takes_mma(x, parts):
        return mma_cuda.flat_matmul(x, *flat, bias=bias)
    inputs = [x]
    if term:
        idx = flat[0]
        hs = _down(x, idx, [part[1] for part in parts])
        inputs.append(idx)
        for part, h in zip(parts, hs, strict=True):
            inputs += [part[0], h, *part[2:]]
    else:
        inputs += [a for part in parts for a in part]
    max_m = 1 if x.shape[0] * x.shape[1] == 1 else MAX_ROWS
    cols, unroll = shape or SHAPES[max_m]
    per_block = WARPS * cols
    blocks = sum(-(-part[0].shape[0] // per_block) for part in parts)
    ys = _project_kernel(len(parts), bias, term)(
        inputs=inputs, template=[("T", x.dtype), ("MAX_M", max_m), ("C", cols), ("U", unroll)],
        grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(*x.shape[:-1], part[0].shape[0]) for part in parts],
        output_dtypes=[x.dtype] * len(parts),
    )  # fmt: skip
    return list(ys)


def _matmul_then_terms(
    x: mx.array, idx: mx.array, parts: list[tuple[mx.array, ...]], bias: bool, fused: bool
) -> list[mx.array]:
    """x W_i^T by `mma_cuda`'s kernel (else MLX's matmul), which read W near the memory's
    speed where `project` with 8 rows reads it at about half (an H200, 7B-shaped MLP: 88 and
    147 us against cuBLAS's 41 and 46), then every term: a `down` launch reducing each row's
    x A once, and an `up` launch adding it; or one `term` launch (`fused`, ranks up to
    MAX_TERM_RANK), whose every block reduces its row's x A again (an H200, 8 adapted rows of
    16 7B-shaped blocks: 1.25x the base's step with down and up, 1.88x with term)."""
    if _takes_mma(x, parts):
        ys = mma_cuda.flat_matmul(x, *(a for p in parts for a in (p[0], *p[3:])), bias=bias)
    else:
        ys = [mx.addmm(p[3], x, p[0].T) if bias else x @ p[0].T for p in parts]
    rank = max(p[1].shape[1] for p in parts)
    if fused and rank <= MAX_TERM_RANK:
        inputs = [x, idx, *(a for y, p in zip(ys, parts, strict=True) for a in (y, p[1], p[2]))]
        return _terms_launch(inputs, [(p[1], p[2]) for p in parts], x, idx, ys[0].shape[:-1])
    hs = _down(x, idx, [p[1] for p in parts])
    total = sum(y.size for y in ys)
    outs = _up_kernel(len(parts))(
        inputs=[idx, *(a for y, h, p in zip(ys, hs, parts, strict=True) for a in (y, h, p[2]))],
        template=[("T", x.dtype)], grid=(total, 1, 1),
        threadgroup=(THREADS, 1, 1), output_shapes=[y.shape for y in ys],
        output_dtypes=[x.dtype] * len(ys),
    )  # fmt: skip
    return list(outs)


def _terms_launch(
    inputs: list[mx.array],
    terms: list[tuple[mx.array, mx.array]],
    x: mx.array,
    idx: mx.array,
    lead: Sequence[int],
    shared: bool = False,
) -> list[mx.array]:
    """Launch the term kernel on `inputs`; outputs (*lead, N_i) for each (at, bt) of `terms`
    (`shared`: the kernel's form reading columns of one y)."""
    per_row = sum(-(-bt.shape[1] // TERM_TILE) for _, bt in terms)
    outs = _term_kernel(len(terms), shared)(
        inputs=inputs,
        template=[("T", x.dtype), ("TILE", TERM_TILE), ("THREADS", THREADS),
                  ("MAX_R", MAX_TERM_RANK)],
        grid=(idx.size * per_row * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, bt.shape[1]) for _, bt in terms],
        output_dtypes=[x.dtype] * len(terms),
    )  # fmt: skip
    return list(outs)


def _add_terms(x: mx.array, idx: mx.array, y: mx.array, *flat: mx.array) -> list[mx.array]:
    """`terms_call`'s launch on flat arguments: the offsets array, then per part at, bt."""
    offsets, rest = flat[0], flat[1:]
    terms = [(rest[i], rest[i + 1]) for i in range(0, len(rest), 2)]
    return _terms_launch([x, idx, y, offsets, *rest], terms, x, idx, y.shape[:-1], shared=True)


_compiled_terms = mx.compile(_add_terms)
_offsets: dict[tuple[int, ...], mx.array] = {}


def terms_call(
    idx: mx.array, parts: Sequence[Part], offsets: Sequence[int]
) -> Callable[[mx.array, mx.array], list[mx.array]]:
    """(x, y) -> y_i + (x A_i[idx]) sB_i[idx]^T, y_i being columns offsets[i].. of y (rows,
    tokens, sum N_i), the output of a fused matmul of x: one launch for every part (adapted,
    ranks up to MAX_TERM_RANK), its arguments fixed once (a decoding batch's steps replay it)."""
    key = tuple(offsets)
    if key not in _offsets:
        _offsets[key] = kernel_array(key, mx.int32)  # two parts' offsets: 8 bytes
    rest = (_offsets[key], *(a for p in parts for a in (p.at, p.bt) if a is not None))
    return lambda x, y: list(_compiled_terms(x, idx, y, *rest))


def takes_terms(parts: Sequence[Part]) -> bool:
    """Whether `terms_call` takes these parts' terms."""
    return all(p.at is not None and p.at.shape[1] <= MAX_TERM_RANK for p in parts)


# Traced once per shape: a step replays the kernels without building their calls again.
_compiled = {
    (bias, term): mx.compile(partial(_project, bias=bias, term=term))
    for bias in (False, True)
    for term in (False, True)
}


def mma_on() -> bool:
    """Whether several rows' base matmuls take `mma_cuda`'s kernel rather than cuBLAS
    (`MLXD_MMA=0` turns it off)."""
    return os.environ.get("MLXD_MMA", "1") not in ("", "0", "false")


def _takes_mma(x: mx.array, parts: Sequence[tuple[mx.array, ...]]) -> bool:
    return mma_on() and all(mma_cuda.fits(x, p[0]) for p in parts)


def batches_take_kernels() -> bool:
    """Whether base rows of a decoding batch take the kernels in forwards queued behind a
    running one (`queued`; `MLXD_BATCH_KERNELS=1`, off by default)."""
    return os.environ.get("MLXD_BATCH_KERNELS", "0") not in ("", "0", "false")


_thread = threading.local()


@contextlib.contextmanager
def queued() -> Iterator[None]:
    """Within, on this thread: forwards built while an earlier one runs on the device (a
    batch's pipelined rounds), where base rows take the kernels (`pays`). Routing projections
    to the kernels adds to a forward's building (the wrappers' Python: 1-4 ms on the fat
    7B-shaped target) and takes from its encoding (cuBLAS's descriptors and algorithm query,
    16-19 us a call, against the kernel's 6-8): a forward queued behind another hides its
    building, one waited for alone pays it while the device idles. An H200, that target
    (`bench/forward_parts.py`, three machine starts): pipelined, 2 to 8 rows took 5.9-10.4 ms
    with the kernels against 5.7-12.4 without; waited for alone, 2 rows 8.8-11.0 against
    7.7-10.4."""
    before = getattr(_thread, "queued", False)
    _thread.queued = True
    try:
        yield
    finally:
        _thread.queued = before


def pays(rows: int, nbytes: int) -> bool:
    """Whether `rows` rows (x tokens) on the base take the kernels for projections of one input
    holding `nbytes` of weights, rather than MLX's matmuls: a batch's, in a forward `queued`
    behind another, through `mma_cuda`'s kernel whatever W's size (an H200, 8 rows of a
    7B-shaped model's 28 blocks: 4.57 ms against cuBLAS's 5.25, the host's share 1.70 against
    4.73), or with it off where W is small enough that the host time cuBLAS calls cost
    outweighs `project`'s slower reading of W. A lone row keeps MLX's gemv: one call for q, k
    and v saved the host less than its Python cost (a 7B-shaped step 0.95x as fast)."""
    if rows <= 1 or not getattr(_thread, "queued", False):
        return False
    return mma_on() or nbytes <= FUSE_BYTES


def bound(idx: mx.array | None, parts: Sequence[Part]) -> Callable[[mx.array], list[mx.array]]:
    """`project` with its slots and parts fixed: x -> the outputs, nothing rebuilt per call
    (a decoding row's steps call it with the same ones every step)."""
    term, bias = parts[0].at is not None, parts[0].bias is not None
    flat = [a for p in parts for a in (p.weight, p.at, p.bt, p.bias) if a is not None]
    call = _compiled[bias, term]
    rest = (*([idx] if term else []), *flat)
    return lambda x: call(x, *rest)


def project(x: mx.array, idx: mx.array | None, parts: Sequence[Part]) -> list[mx.array]:
    """x W_i^T (+ (x A_i[idx - 1]) sB_i[idx - 1]^T) (+ bias_i) for projections i of one input
    x (batch rows, tokens, K), idx (rows x tokens,) uint32 (0: no term): one kernel launch, two
    with terms for a lone row (several rows: the matmuls, then down and up). The parts all have
    terms (and idx is given) or none do; a bias, or none do."""
    return bound(idx, parts)(x)


def warm(dtype: mx.Dtype, count: int, bias: bool, term: bool) -> None:
    """Build the kernels a call for `count` projections of one input takes, for `dtype` and
    lone rows and batches (base rows: every tile count of the tensor-core kernel's, verify
    rounds take them too), now (at load or mount), not in a row's first step."""
    key = (dtype, count, bias, term)
    if key in _warmed:
        return
    k, n, slots, rank = 64, 8, 2, 8
    part = Part(
        mx.zeros((slots, rank, k), dtype=dtype) if term else None,
        mx.zeros((n, k), dtype=dtype),
        mx.zeros((slots, n, rank), dtype=dtype) if term else None,
        mx.zeros((n,), dtype=dtype) if bias else None,
    )
    outs = []
    batches = (2, 9, 17, 25) if mma_on() and not term else (2,)
    for rows in (1, *batches) if term else batches:  # base rows take them in batches only
        x = mx.zeros((rows, 1, k), dtype=dtype)
        idx = mx.ones((rows,), dtype=mx.uint32)
        outs += project(x, idx if term else None, [part] * count)
        if term and rows > 1:  # the form a fused gate and up take
            y = mx.zeros((rows, 1, n * count), dtype=dtype)
            outs += terms_call(idx, [part] * count, [n * i for i in range(count)])(x, y)
    mx.eval(outs)
    _warmed.add(key)


_warmed: set[tuple[mx.Dtype, int, bool, bool]] = set()
