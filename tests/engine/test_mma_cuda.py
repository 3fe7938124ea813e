"""`mma_cuda`: few-row matmuls on tensor cores against MLX's matmul (on MLX's CUDA build), and
everywhere which inputs it takes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine import mma_cuda
from mlxd.engine.attention import cuda_available


def test_it_takes_up_to_32_rows_of_a_two_byte_float_in_16_byte_pieces() -> None:
    w = mx.zeros((32, 64), dtype=mx.bfloat16)
    assert mma_cuda.fits(mx.zeros((8, 1, 64), dtype=mx.bfloat16), w)
    assert mma_cuda.fits(mx.zeros((2, 4, 64), dtype=mx.bfloat16), w)
    assert mma_cuda.fits(mx.zeros((4, 8, 64), dtype=mx.bfloat16), w)
    assert not mma_cuda.fits(mx.zeros((33, 1, 64), dtype=mx.bfloat16), w)
    assert not mma_cuda.fits(mx.zeros((1, 33, 64), dtype=mx.bfloat16), w)
    assert not mma_cuda.fits(mx.zeros((2, 1, 64), dtype=mx.float16), w)
    assert not mma_cuda.fits(mx.zeros((2, 1, 64), dtype=mx.float32), w.astype(mx.float32))
    assert not mma_cuda.fits(
        mx.zeros((2, 1, 60), dtype=mx.bfloat16), mx.zeros((32, 60), dtype=mx.bfloat16)
    )
    assert not mma_cuda.fits(mx.zeros((2, 64), dtype=mx.bfloat16), w)


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 23, 32])
def test_it_matches_mlx_matmul(dtype: mx.Dtype, rows: int) -> None:
    """Several projections of one input, outputs not a multiple of 16, K a multiple of 8 but
    not of the warps' stride, with and without biases; float32 references."""
    mx.random.seed(rows)
    k = 8 * 97
    ns = (48, 200, 8)
    x = mx.random.normal((rows, 1, k)).astype(dtype)
    ws = [(0.05 * mx.random.normal((n, k))).astype(dtype) for n in ns]
    bs = [mx.random.normal((n,)).astype(dtype) for n in ns]
    for biases in (None, bs):
        ys = mma_cuda.matmul(x, ws, biases)
        for i, (w, y) in enumerate(zip(ws, ys, strict=True)):
            ref = x.astype(mx.float32) @ w.astype(mx.float32).T
            if biases is not None:
                ref = ref + biases[i].astype(mx.float32)
            assert y.shape == (rows, 1, w.shape[0]) and y.dtype == dtype
            err = mx.abs(y.astype(mx.float32) - ref).max().item()
            assert err <= 2e-2 * (1 + mx.abs(ref).max().item()), (i, err)


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
def test_rows_times_tokens_are_its_rows() -> None:
    mx.random.seed(3)
    for shape in ((2, 4, 256), (3, 7, 256)):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        w = (0.05 * mx.random.normal((64, 256))).astype(mx.bfloat16)
        (y,) = mma_cuda.matmul(x, [w])
        ref = x.astype(mx.float32) @ w.astype(mx.float32).T
        assert y.shape == (*shape[:2], 64)
        assert mx.abs(y.astype(mx.float32) - ref).max().item() < 5e-2
