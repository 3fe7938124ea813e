"""LoRA projections for decoding on MLX's CUDA build: the base matmul and the term in two kernels.

Decoding multiplies a few rows by each weight, so a projection is one memory-bound pass over W
and a low-rank term is nothing but its kernel launches. On an H200 (7B shapes, bf16, the last
16 blocks adapted) the term as MLX ops (two gathered matmuls and an add per projection) cost a
lone row 30-45 % of its step: each op reduces over K for 8 outputs on one or two SMs. Here:

- `down`: h_i = x A_i[slot] for every row, for up to three projections of one input at once
  (q, k, v; gate, up), one block per (row, rank index), each reducing K with 256 threads in
  float32;
- `gemv`: y = x W^T + h sB[slot]^T (+ bias), a warp per output column as MLX's own gemv does,
  every row of x against each loaded piece of W, the low-rank term added in the epilogue; it
  replaces the base projection's matmul.

So a block of seven adapted projections launches four kernels more than the base's, not 21.
Both are traced by `mx.compile`, so a step replays them without building their calls in Python.
Forwards of more than `MAX_ROWS` rows x tokens (prefill, wide verifies) are compute-bound and
take the MLX ops. The kernels read K in 16-byte pieces: K a multiple of 8 and a 2-byte dtype
(bf16, fp16), which `serves` checks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

__all__ = ["MAX_GROUP", "MAX_ROWS", "down", "fits", "gemv", "serves", "warm"]

MAX_ROWS = 8  # rows of x (batch rows x tokens) the kernels take; more take the MLX ops
THREADS = 256
COLS_PER_BLOCK = THREADS // 32  # gemv: a warp per output column


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
        ar += ((size_t)s * R + jj) * K;
        for (int k = threadIdx.x * 8; k < K; k += blockDim.x * 8) {{
            uint4 xv = *reinterpret_cast<const uint4*>(xr + k);
            uint4 av = *reinterpret_cast<const uint4*>(ar + k);
            const T* xp = reinterpret_cast<const T*>(&xv);
            const T* ap = reinterpret_cast<const T*>(&av);
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc += static_cast<float>(xp[i]) * static_cast<float>(ap[i]);
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


_GEMV = """
    const int M = x_shape[0] * x_shape[1];
    const int K = x_shape[2];
    const int N = w_shape[0];
    const int R = bt_shape[2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = blockIdx.x * (blockDim.x / 32) + warp;
    if (n >= N) return;
    float acc[MAX_M];
    #pragma unroll
    for (int m = 0; m < MAX_M; ++m) acc[m] = 0.0f;
    const T* wr = w + (size_t)n * K;
    for (int k = lane * 8; k < K; k += 32 * 8) {
        uint4 wv = *reinterpret_cast<const uint4*>(wr + k);
        const T* wp = reinterpret_cast<const T*>(&wv);
        float wf[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) wf[i] = static_cast<float>(wp[i]);
        #pragma unroll
        for (int m = 0; m < MAX_M; ++m) {
            if (m < M) {
                uint4 xv = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
                const T* xp = reinterpret_cast<const T*>(&xv);
                #pragma unroll
                for (int i = 0; i < 8; ++i) acc[m] += wf[i] * static_cast<float>(xp[i]);
            }
        }
    }
    float v = 0.0f;
    #pragma unroll
    for (int m = 0; m < MAX_M; ++m) {
        if (m < M) {
            float a = acc[m];
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
            if (lane == m) v = a;
        }
    }
    if (lane < M) {
        const int m = lane;
        const uint32_t s = idx[m];
        if (s != 0) {
            const T* br = bt + ((size_t)s * N + n) * R;
            for (int j = 0; j < R; ++j) v += h[m * R + j] * static_cast<float>(br[j]);
        }
        BIAS
        y[(size_t)m * N + n] = static_cast<T>(v);
    }
"""

MAX_GROUP = 3  # projections of one input whose h one kernel computes (q, k, v)
_downs: dict[int, Any] = {}
_gemvs: dict[bool, Any] = {}


def _down_kernel(count: int) -> Any:
    if count not in _downs:
        _downs[count] = mx.fast.cuda_kernel(
            name=f"mlxd_lora_down{count}",
            input_names=["x", *(f"at{i}" for i in range(count)), "idx"],
            output_names=[f"h{i}" for i in range(count)],
            source=_down_source(count),
        )
    return _downs[count]


def _gemv_kernel(bias: bool) -> Any:
    if bias not in _gemvs:
        _gemvs[bias] = mx.fast.cuda_kernel(
            name="mlxd_lora_gemv_bias" if bias else "mlxd_lora_gemv",
            input_names=["x", "w", "h", "bt", "idx"] + (["bias"] if bias else []),
            output_names=["y"],
            source=_GEMV.replace("BIAS", "v += static_cast<float>(bias[n]);" if bias else ""),
        )
    return _gemvs[bias]


def fits(x: mx.array, dtype: mx.Dtype) -> bool:
    """Whether the kernels take input x (batch rows, tokens, K) of a projection in `dtype`."""
    return x.ndim == 3 and x.dtype == dtype and x.shape[0] * x.shape[1] <= MAX_ROWS


def serves(weight: mx.array) -> bool:
    """Whether the kernels take this weight (N, K): a 2-byte float, K in 16-byte pieces."""
    return weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % 8 == 0


def _down(x: mx.array, idx: mx.array, *ats: mx.array) -> list[mx.array]:
    rows = x.shape[0] * x.shape[1]
    width = sum(at.shape[1] for at in ats)
    hs = _down_kernel(len(ats))(
        inputs=[x, *ats, idx], template=[("T", x.dtype)],
        grid=(rows * width * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, at.shape[1]) for at in ats], output_dtypes=[mx.float32] * len(ats),
    )  # fmt: skip
    return list(hs)


def _gemv(
    x: mx.array, weight: mx.array, h: mx.array, bt: mx.array, idx: mx.array, *bias: mx.array
) -> mx.array:
    n = weight.shape[0]
    (y,) = _gemv_kernel(bool(bias))(
        inputs=[x, weight, h, bt, idx, *bias], template=[("T", x.dtype), ("MAX_M", MAX_ROWS)],
        grid=(-(-n // COLS_PER_BLOCK) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype],
    )  # fmt: skip
    return y


# Traced once per shape: a step replays the kernels without building their calls again.
down = mx.compile(_down)
"""h_i = x A_i[idx] (float32, (rows x tokens, r_i)) for projections i of the same input x
(batch rows, tokens, K); at_i (slots, r_i, K); idx (rows x tokens,) uint32, 0: no term."""

_gemv_compiled = mx.compile(_gemv)


def gemv(
    x: mx.array,
    weight: mx.array,
    h: mx.array,
    bt: mx.array,
    idx: mx.array,
    bias: mx.array | None,
) -> mx.array:
    """x W^T + h sB[idx]^T (+ bias): weight (N, K), bt (slots, N, r) each slot's (sB)^T."""
    if bias is None:
        return _gemv_compiled(x, weight, h, bt, idx)
    return _gemv_compiled(x, weight, h, bt, idx, bias)


def warm(dtype: mx.Dtype) -> None:
    """Build the kernels for `dtype` now (at mount), not in a row's first step."""
    if dtype in _warmed:
        return
    k, n, slots, rank = 64, 8, 2, 8
    x = mx.zeros((1, 1, k), dtype=dtype)
    idx = mx.ones((1,), dtype=mx.uint32)
    w = mx.zeros((n, k), dtype=dtype)
    at, bt = mx.zeros((slots, rank, k), dtype=dtype), mx.zeros((slots, n, rank), dtype=dtype)
    outs = []
    for count in range(1, MAX_GROUP + 1):
        hs = down(x, idx, *([at] * count))
        outs += [gemv(x, w, hs[0], bt, idx, None), gemv(x, w, hs[0], bt, idx, w[:, 0])]
    mx.eval(outs)
    _warmed.add(dtype)


_warmed: set[mx.Dtype] = set()
