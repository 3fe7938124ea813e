"""The host's time per operation on MLX's CUDA build: built-in ops against custom kernels.

    python bench/launch_cost.py [--ops 1000]

A lone row's decode step on a GPU is bound by the host's work per operation, so what one op
costs the host decides what a kernel must save to pay. This chains `--ops` dependent calls of
each kind on a tiny array and prints, per call, the Python time building the graph and MLX's
time encoding it (`mx.async_eval`), then the device time for the whole chain:

- a built-in add;
- a one-line custom kernel (`mx.fast.cuda_kernel`), and the same with 8 KB of source;
- mlxd's batch decode-attention kernel (`engine.attention.ragged_cuda`, 2 rows, 28 query and
  4 key heads of 128, 600 of 1,024 keys) next to MLX's attention on one row's keys;
- a 7B-shaped projection (3584 x 3584, bf16) of 1, 2 and 16 rows by MLX's matmul (a gemv for
  one row, cuBLAS for more) and of 2 and 16 by mlxd's tensor-core kernel (`engine.mma_cuda`).
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

import mlx.core as mx

from mlxd.engine import mma_cuda
from mlxd.engine.attention import cuda_available, ragged_cuda
from mlxd.engine.smallarrays import kernel_array

BODY = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
BODY += "if (i < (unsigned int)a_shape[1]) o[i] = a[i] + (T)1;\n"


def stages(build: Callable[[], Any]) -> tuple[float, float, float]:
    """Seconds of one graph's stages: `build` (Python building it), `mx.async_eval` (MLX
    encoding it) and the wait for the device after."""
    t0 = time.perf_counter()
    out = build()
    t1 = time.perf_counter()
    mx.async_eval(out)
    t2 = time.perf_counter()
    mx.eval(out)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def timed(name: str, build: Callable[[], mx.array], n: int) -> None:
    mx.eval(build())  # compiled and warm
    building, encoding, waiting = stages(build)
    per = 1e6 / n
    print(
        f"{name:34s} build {building * per:6.2f} us  encode {encoding * per:6.2f} us  "
        f"device {waiting * 1e3:6.2f} ms in all"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=1000)
    n = ap.parse_args().ops
    if not cuda_available():
        raise SystemExit("this measures MLX's CUDA build; no CUDA device here")
    x = mx.zeros((1, 4096), dtype=mx.bfloat16)
    mx.eval(x)

    def custom(source: str, name: str) -> Callable[[mx.array], mx.array]:
        kernel = mx.fast.cuda_kernel(
            name=name, input_names=["a"], output_names=["o"], source=source
        )

        def step(y: mx.array) -> mx.array:
            (out,) = kernel(
                inputs=[y], template=[("T", y.dtype)], grid=(y.size, 1, 1),
                threadgroup=(256, 1, 1), output_shapes=[y.shape], output_dtypes=[y.dtype],
            )  # fmt: skip
            return out

        return step

    timed("built-in add", chain_from(x, lambda y: y + 1, n), n)
    timed("custom kernel", chain_from(x, custom(BODY, "mlxd_bench_short"), n), n)
    timed(
        "custom kernel, 8 KB source",
        chain_from(x, custom(BODY + "//\n" * 2700, "mlxd_bench_long"), n),
        n,
    )

    rows, heads, kv_heads, dim, keys = 2, 28, 4, 128, 1024
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, keys, dim)).astype(mx.bfloat16)
    v = mx.random.normal((rows, kv_heads, keys, dim)).astype(mx.bfloat16)
    left = kernel_array([0, 10], mx.int32)
    k1, v1 = k[:1, :, :600], v[:1, :, :600]
    mx.eval(q, k, v, k1, v1)
    calls = max(n // 4, 1)
    timed(
        "mlxd batch decode attention",
        chain_from(q, lambda y: ragged_cuda(y, k, v, 0.088, left, 600), calls),
        calls,
    )
    q1 = q[:1]

    def sdpa() -> mx.array:
        y = q1
        for _ in range(calls):
            y = mx.fast.scaled_dot_product_attention(y, k1, v1, scale=0.088)
        return y

    timed("MLX attention, one row", sdpa, calls)

    # A projection's call, 3584 x 3584 bf16: MLX's gemv for one row, cuBLAS for several (its
    # descriptors and algorithm query each call), mlxd's tensor-core kernel (a compiled call).
    w = (0.01 * mx.random.normal((3584, 3584))).astype(mx.bfloat16)
    mx.eval(w)
    for rows in (1, 2, 16):
        h = mx.zeros((rows, 1, 3584), dtype=mx.bfloat16)
        mx.eval(h)
        timed(f"matmul, {rows} row(s)", chain_from(h, lambda y: y @ w.T, calls), calls)
        if rows > 1:
            timed(
                f"mlxd mma kernel, {rows} rows",
                chain_from(h, lambda y: mma_cuda.matmul(y, [w])[0], calls),
                calls,
            )


def chain_from(
    x: mx.array, step: Callable[[mx.array], mx.array], count: int
) -> Callable[[], mx.array]:
    """`count` dependent calls of `step` from x."""

    def build() -> mx.array:
        y = x
        for _ in range(count):
            y = step(y)
        return y

    return build


if __name__ == "__main__":
    main()
