"""`qmma_cuda`: 4-bit few-row matmuls on tensor cores against MLX's quantized matmul (on MLX's
CUDA build), and everywhere which projections and inputs it takes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine import qmma_cuda
from mlxd.engine.attention import cuda_available


def quantized(n: int, k: int, group_size: int, bits: int = 4) -> qmma_cuda.Quantized:
    w = 0.05 * mx.random.normal((n, k))
    packed, scales, offsets = mx.quantize(w, group_size=group_size, bits=bits)
    return packed, scales.astype(mx.bfloat16), offsets.astype(mx.bfloat16)


def test_it_takes_4_bit_affine_projections_and_up_to_32_rows_in_their_dtype() -> None:
    w, s, _ = quantized(32, 256, 64)
    assert qmma_cuda.serves(w, s, 64, 4)
    assert qmma_cuda.fits(mx.zeros((1, 7, 256), dtype=mx.bfloat16), w, s, 64, 4)
    assert qmma_cuda.fits(mx.zeros((4, 8, 256), dtype=mx.bfloat16), w, s, 64, 4)
    assert not qmma_cuda.fits(mx.zeros((1, 33, 256), dtype=mx.bfloat16), w, s, 64, 4)
    assert not qmma_cuda.fits(mx.zeros((1, 2, 256), dtype=mx.float16), w, s, 64, 4)
    assert not qmma_cuda.fits(mx.zeros((1, 2, 128), dtype=mx.bfloat16), w, s, 64, 4)
    assert not qmma_cuda.fits(mx.zeros((2, 256), dtype=mx.bfloat16), w, s, 64, 4)
    eight, s8, _ = quantized(32, 256, 64, bits=8)
    assert not qmma_cuda.serves(eight, s8, 64, 8)
    assert not qmma_cuda.serves(w, s.astype(mx.float32), 64, 4)


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
@pytest.mark.parametrize(
    ("dtype", "group_size"),
    [(mx.bfloat16, 32), (mx.bfloat16, 64), (mx.bfloat16, 128), (mx.float16, 64)],
)
@pytest.mark.parametrize("rows", [1, 3, 9, 17, 32])
def test_it_matches_mlx_quantized_matmul(dtype: mx.Dtype, group_size: int, rows: int) -> None:
    """Several projections of one input, outputs not a multiple of 16, K not a multiple of
    the warps' stride, with and without biases; float32 references on the same weights."""
    mx.random.seed(rows + group_size)
    k = 128 * 13
    ns = (48, 200, 8)
    x = mx.random.normal((1, rows, k)).astype(dtype)
    parts = []
    for n in ns:
        packed, scales, offsets = quantized(n, k, group_size)
        parts.append((packed, scales.astype(dtype), offsets.astype(dtype)))
    bs = [mx.random.normal((n,)).astype(dtype) for n in ns]
    for biases in (None, bs):
        ys = qmma_cuda.matmul(x, parts, biases, group_size)
        for i, ((w, s, o), y) in enumerate(zip(parts, ys, strict=True)):
            full = mx.dequantize(w, s.astype(mx.float32), o.astype(mx.float32), group_size, 4)
            ref = x.astype(mx.float32) @ full.T
            if biases is not None:
                ref = ref + biases[i].astype(mx.float32)
            assert y.shape == (1, rows, w.shape[0]) and y.dtype == dtype
            err = mx.abs(y.astype(mx.float32) - ref).max().item()
            assert err <= 2e-2 * (1 + mx.abs(ref).max().item()), (i, err)


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
def test_rows_times_tokens_are_its_rows() -> None:
    mx.random.seed(3)
    for shape in ((2, 4, 256), (3, 7, 256)):
        x = mx.random.normal(shape).astype(mx.bfloat16)
        w, s, o = quantized(64, 256, 64)
        (y,) = qmma_cuda.matmul(x, [(w, s, o)], None, 64)
        ref = mx.quantized_matmul(x, w, s, o, transpose=True, group_size=64, bits=4)
        assert y.shape == (*shape[:2], 64)
        assert mx.abs(y.astype(mx.float32) - ref.astype(mx.float32)).max().item() < 5e-2
