"""Quantized projections on a CPU: forwards of many rows multiply a dequantized weight, and
give what the packed kernel gives (to float rounding)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import convert

from mlxd.engine import dequant
from mlxd.engine.backend import Backend
from mlxd.engine.dequant import DequantizingLinear
from mlxd.engine.pairing import load_model
from tests.fixtures.tiny_models import build_model


def quantized(bias: bool) -> nn.QuantizedLinear:
    mx.random.seed(0)
    layer = nn.Linear(128, 96, bias=bias)
    return nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 3), (8, 1), (2, 9)])
def test_every_row_count_gives_the_packed_kernels_output(
    bias: bool, shape: tuple[int, int]
) -> None:
    packed = quantized(bias)
    routed = quantized(bias)
    assert dequant.install(routed) == 1 and type(routed) is DequantizingLinear
    x = mx.random.normal((*shape, 128), key=mx.random.key(1))
    want, got = packed(x), routed(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


def test_a_large_weight_is_copied_a_block_of_outputs_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """96 outputs of 128 inputs, 40 outputs' float32 copy at a time: three blocks."""
    monkeypatch.setattr(dequant, "BLOCK_BYTES", 40 * 128 * 4)
    calls: list[int] = []
    real = mx.dequantize

    def counted(w: mx.array, *args: object, **kwargs: object) -> mx.array:
        calls.append(w.shape[0])
        return real(w, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mx, "dequantize", counted)
    packed, routed = quantized(True), quantized(True)
    dequant.install(routed)
    x = mx.random.normal((2, 5, 128), key=mx.random.key(2))
    want, got = packed(x), routed(x)
    assert calls == [40, 40, 16]
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()


def test_few_rows_keep_the_packed_kernel_and_many_dequantize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = mx.dequantize

    def counted(*args: object, **kwargs: object) -> mx.array:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mx, "dequantize", counted)
    layer = quantized(False)
    dequant.install(layer)
    for rows, dequantized in ((1, 0), (dequant.MIN_ROWS - 1, 0), (dequant.MIN_ROWS, 1), (64, 1)):
        calls.clear()
        mx.eval(layer(mx.zeros((1, rows, 128))))
        assert len(calls) == dequantized, rows


def test_a_quantized_model_on_a_cpu_with_a_fast_blas_takes_the_route(tmp_path: Path) -> None:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    source = build_model(tmp_path, "bf16", seed=3, dtype="bfloat16", **shape)
    path = tmp_path / "q4"
    convert(str(source), str(path), quantize=True, q_group_size=64, q_bits=4)
    blas = Backend("cpu", "libmkl", "", True, None, False, None, quantized_float32=True)
    routed = load_model(path, blas)[0]
    kinds = {type(m) for _, m in routed.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert kinds == {DequantizingLinear}
    # MLX's own BLAS: its float32 matmul is slower than the packed kernel, so nothing changes
    own = Backend("cpu", None, "", False, None, False, None, quantized_float32=True)
    packed = load_model(path, own)[0]
    kinds = {type(m) for _, m in packed.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert kinds == {nn.QuantizedLinear}
    prompt = mx.array([[3, 5, 7, 11, 13, 17]])
    want, got = packed(prompt), routed(prompt)
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3).item()
