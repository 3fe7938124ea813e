"""An MLP's gate and up projections as one matmul (`engine.fusedproj`): the model computes what
it computed, one matmul per MLP, its weights held once, for float and quantized projections."""

from __future__ import annotations

import gc
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine import fusedproj
from mlxd.engine.backend import configure_backend
from mlxd.engine.fusedproj import SharedLinear, SharedQuantizedLinear, fuse_gate_up
from mlxd.engine.kvcache import make_cache
from mlxd.engine.pairing import load_model
from tests.engine.conftest import backend_says
from tests.fixtures.tiny_models import TinyPair

LAYERS = 3


def tiny_model(seed: int = 0, bias: bool = False) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
        mlp_bias=bias,
    )  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def decode(model: nn.Module, steps: int = 4) -> mx.array:
    """Logits of a prompt's forward and of a few single-token steps after it."""
    cache = make_cache(model)
    outs = [model(mx.array([[3, 1, 4, 1, 5]]), cache=cache)]
    for t in range(steps):
        outs.append(model(mx.array([[(7 * t) % 50]]), cache=cache))
    return mx.concatenate(outs, axis=1)


def counted_matmuls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = fusedproj._Shared._matmul

    def counted(self: fusedproj._Shared, x: mx.array) -> mx.array:
        calls.append(1)
        return original(self, x)

    monkeypatch.setattr(fusedproj._Shared, "_matmul", counted)
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_and_up_compute_what_they_did(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    plain, fused = tiny_model(bias=bias), tiny_model(bias=bias)
    assert fuse_gate_up(fused) == LAYERS
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp.gate_proj, SharedLinear) and isinstance(mlp.up_proj, SharedLinear)
    calls = counted_matmuls(monkeypatch)
    got = decode(fused)
    assert len(calls) == LAYERS * 5  # one matmul per MLP per forward, not two
    assert mx.allclose(got, decode(plain), rtol=1e-5, atol=1e-5).item()


def test_quantized_projections_fuse_alike() -> None:
    plain, fused = tiny_model(1), tiny_model(1)
    for model in (plain, fused):
        nn.quantize(model, group_size=32, bits=4)
    assert fuse_gate_up(fused) == LAYERS
    up = fused.model.layers[1].mlp.up_proj
    assert isinstance(up, SharedQuantizedLinear) and isinstance(up, nn.QuantizedLinear)
    assert (up.group_size, up.bits) == (32, 4)
    assert mx.allclose(decode(fused), decode(plain), rtol=1e-5, atol=1e-5).item()


def test_the_weights_are_held_once() -> None:
    """Each projection's weight is a view of the fused one: fusing frees the separate weights
    and adds nothing (beyond what the concatenation's rounding to pages may)."""
    model = tiny_model(2)
    gc.collect()
    before = mx.get_active_memory()
    fuse_gate_up(model)
    gc.collect()
    mlp = model.model.layers[0].mlp
    assert mx.get_active_memory() - before < mlp.gate_proj.weight.nbytes  # not a copy more
    shared = mlp.gate_proj.shared
    assert shared is mlp.up_proj.shared
    assert mx.array_equal(mx.concatenate([mlp.gate_proj.weight, mlp.up_proj.weight]), shared.weight)


def test_a_projection_called_with_another_input_computes_its_own() -> None:
    model = tiny_model(3)
    mlp = model.model.layers[0].mlp
    x1, x2 = mx.random.normal((1, 2, 64)), mx.random.normal((1, 2, 64))
    want_gate, want_up = mlp.gate_proj(x1), mlp.up_proj(x2)
    fuse_gate_up(model)
    mlp = model.model.layers[0].mlp
    assert mx.allclose(mlp.gate_proj(x1), want_gate, atol=1e-6).item()
    assert mx.allclose(mlp.up_proj(x2), want_up, atol=1e-6).item()
    assert mx.allclose(mlp.up_proj(x1), mx.matmul(x1, mlp.up_proj.weight.T), atol=1e-6).item()
    assert not mlp.up_proj.shared.waiting or mlp.up_proj.shared.x is x1


def test_unlike_projections_stay_apart() -> None:
    """A float gate beside a quantized up (or any other mix) is left as it is."""
    model = tiny_model(4)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = nn.QuantizedLinear.from_linear(mlp.up_proj, group_size=32, bits=4)
    assert fuse_gate_up(model) == LAYERS - 1
    assert type(model.model.layers[0].mlp.gate_proj) is nn.Linear


def test_models_load_fused_where_the_backend_fuses(tiny_pair: TinyPair) -> None:
    """`load_model` fuses on a backend that says so (the GPU's) and computes as before."""
    plain = load_model(tiny_pair.target, replace(configure_backend(), fused_mlp=False))[0]
    fused = load_model(tiny_pair.target, replace(configure_backend(), fused_mlp=True))[0]
    shared = [m for _, m in fused.named_modules() if isinstance(m, SharedLinear)]
    assert len(shared) == 2 * len(fused.layers)
    assert not any(isinstance(m, SharedLinear) for _, m in plain.named_modules())
    assert mx.allclose(decode(fused), decode(plain), rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("value", [None, "0", "1"])
def test_the_backend_fuses_only_when_asked(value: str | None) -> None:
    """Off unless `MLXD_FUSE_MLP=1`, and never on the CPU (whose matmuls are not launch-bound)."""
    printed = "import mlx.core as mx; print(b.fused_mlp, mx.default_device().type == mx.gpu)"
    fused, on_gpu = backend_says("MLXD_FUSE_MLP", value, printed)
    assert fused == (value == "1" and on_gpu)
