"""The CUDA decode path of `RowLoRA`: its kernels against MLX ops (on MLX's CUDA build), and
everywhere the dispatch around them: which projections share one `down` kernel per forward and
which term each reads, with the kernels' arithmetic done by MLX ops."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine import lora, lora_cuda
from mlxd.engine.attention import cuda_available
from mlxd.engine.lora import LayerWeights, Selection, wrap

PROJECTIONS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]  # fmt: skip


def down_by_ops(x: mx.array, idx: mx.array, *ats: mx.array) -> list[mx.array]:
    """The kernel's arithmetic: slot 0 (no adapter) has no term."""
    flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    on = (idx != 0)[:, None]
    return [on * (flat[:, None, :] * at[idx].astype(mx.float32)).sum(-1) for at in ats]


def gemv_by_ops(
    x: mx.array, weight: mx.array, h: mx.array, bt: mx.array, idx: mx.array, bias: mx.array | None
) -> mx.array:
    flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    y = flat @ weight.astype(mx.float32).T
    y = y + (idx != 0)[:, None] * (h[:, None, :] * bt[idx].astype(mx.float32)).sum(-1)
    if bias is not None:
        y = y + bias.astype(mx.float32)
    return y.astype(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def tiny_model(seed: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
    )  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def mount(model: nn.Module, selection: Selection) -> None:
    """Three adapters on every projection, except that slot 3 leaves block 1's k_proj alone."""
    for layer in range(2):
        for path in PROJECTIONS:
            row = wrap(model, f"model.layers.{layer}.{path}", selection)
            d_out, d_in = row.base.weight.shape
            for slot in (1, 2, 3):
                if slot == 3 and layer == 1 and path.endswith("k_proj"):
                    continue
                rank = 16 if slot == 2 else 8
                ka, kb = mx.random.split(mx.random.key(10 * slot + layer))
                a = 0.3 * mx.random.normal((d_in, rank), key=ka)
                b = 0.3 * mx.random.normal((rank, d_out), key=kb)
                row.put(slot, LayerWeights(a, b, 2.0))


def test_projections_of_one_input_share_one_down_per_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q, k, v (and gate, up) take their x A terms from one kernel call; a projection whose
    adapters differ (k without slot 3) gets its own; every row's logits are the MLX-ops path's."""
    plain_sel, fused_sel = Selection(), Selection()
    plain, fused = tiny_model(0), tiny_model(0)
    mount(plain, plain_sel)
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype: None)
    mount(fused, fused_sel)
    calls: list[int] = []

    def counted(x: mx.array, idx: mx.array, *ats: mx.array) -> list[mx.array]:
        calls.append(len(ats))
        return down_by_ops(x, idx, *ats)

    monkeypatch.setattr(lora_cuda, "down", counted)
    monkeypatch.setattr(lora_cuda, "gemv", gemv_by_ops)
    # block 0: q, k, v in one call; block 1: k holds other slots than q and v, so its own call
    expected = [3, 1, 2, 1, 2, 1, 1, 2, 1]
    for slots, length in (([1], 1), ([2, 0, 1], 2)):
        tokens = mx.array([[(5 * r + t) % 50 for t in range(length)] for r in range(len(slots))])
        calls.clear()
        outs = []
        for model, selection in ((fused, fused_sel), (plain, plain_sel)):
            selection.set(slots)
            outs.append(model(tokens))
            selection.clear()
        assert calls == expected
        assert mx.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4).item()
    calls.clear()
    fused_sel.set([3])  # block 1's k_proj is the base's for these rows: no term at all
    fused(mx.array([[1, 2]]))
    fused_sel.clear()
    assert calls == [3, 1, 2, 1, 2, 1, 2, 1]


def test_rows_past_the_kernels_limit_take_the_mlx_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype: None)
    model, selection = tiny_model(1), Selection()
    mount(model, selection)

    def refused(*args: object) -> None:
        raise AssertionError("the kernels took more rows than they serve")

    monkeypatch.setattr(lora_cuda, "down", refused)
    selection.set([1])
    logits = model(mx.zeros((1, lora_cuda.MAX_ROWS + 1), dtype=mx.int32))  # a prompt's forward
    selection.clear()
    assert logits.shape == (1, lora_cuda.MAX_ROWS + 1, 50)


@pytest.mark.skipif(not cuda_available(), reason="the kernels run on MLX's CUDA build")
def test_kernels_match_mlx_ops() -> None:
    dtype = mx.bfloat16
    for k, n in ((64, 48), (512, 1024), (2048, 256)):
        for slots, length in (([1], 1), ([2, 0, 1, 1], 1), ([1, 2], 3), ([1] * 8, 1)):
            keys = mx.random.split(mx.random.key(k + n + len(slots)), 6)
            x = mx.random.normal((len(slots), length, k), key=keys[0]).astype(dtype)
            w = (0.05 * mx.random.normal((n, k), key=keys[1])).astype(dtype)
            ats = [
                (0.05 * mx.random.normal((3, r, k), key=keys[2 + i])).astype(dtype)
                for i, r in enumerate((8, 16))
            ]
            bt = (0.05 * mx.random.normal((3, n, 16), key=keys[4])).astype(dtype)
            idx = mx.repeat(mx.array(slots, dtype=mx.uint32), length)
            hs = lora_cuda.down(x, idx, *ats)
            for h, want in zip(hs, down_by_ops(x, idx, *ats), strict=True):
                assert mx.allclose(h, want, rtol=1e-3, atol=1e-3).item()
            for b in (None, (0.05 * mx.random.normal((n,), key=keys[5])).astype(dtype)):
                y = lora_cuda.gemv(x, w, hs[1], bt, idx, b).astype(mx.float32)
                want = gemv_by_ops(x, w, hs[1], bt, idx, b).astype(mx.float32)
                tol = 2e-2 * mx.abs(want).max().item()
                assert mx.allclose(y, want, rtol=0.0, atol=tol).item(), (k, n, slots, length)
