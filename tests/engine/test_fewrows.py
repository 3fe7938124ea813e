"""`fewrows`: a lone row's forwards of a few tokens compute each group of projections (q, k, v;
gate, up; o; down) in one call, and nothing else changes: every other forward keeps
`nn.Linear`'s matmul, the logits stay the model's, and adapters wrap the grouped layers."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, qwen2

from mlxd.engine import fewrows, lora
from mlxd.engine.attention import cuda_available
from mlxd.engine.fewrows import FewRowsLinear, FewRowsQuantizedLinear, group_projections
from mlxd.engine.kvcache import make_cache
from tests.engine.conftest import backend_says


def tiny(kind: str = "llama", dtype: mx.Dtype = mx.bfloat16, bits: int = 0) -> nn.Module:
    """A 2-block model (`bits`: its projections quantized, groups of 32)."""
    shape = dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
    )  # fmt: skip
    mx.random.seed(0)
    if kind == "qwen2":  # q, k and v biased
        model: nn.Module = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **shape))  # type: ignore[arg-type]
    else:
        model = llama.Model(llama.ModelArgs(model_type="llama", **shape))  # type: ignore[arg-type]
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


class Counting:
    """Each group's projections computed as MLX's matmul computes one projection, counted."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(
        self, x: mx.array, weights: Sequence[mx.array], biases: Sequence[mx.array] | None
    ) -> list[mx.array]:
        self.calls.append(len(weights))
        if biases is None:
            return [x @ w.T for w in weights]
        return [mx.addmm(b, x, w.T) for w, b in zip(weights, biases, strict=True)]


class CountingQuantized:
    """Each quantized group's projections computed as `nn.QuantizedLinear` computes one,
    counted."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(
        self,
        x: mx.array,
        parts: Sequence[tuple[mx.array, mx.array, mx.array]],
        biases: Sequence[mx.array] | None,
        group_size: int,
    ) -> list[mx.array]:
        self.calls.append(len(parts))
        ys = [
            mx.quantized_matmul(x, w, s, o, transpose=True, group_size=group_size, bits=4)
            for w, s, o in parts
        ]
        return ys if biases is None else [y + b for y, b in zip(ys, biases, strict=True)]


def logits(model: nn.Module, tokens: list[list[int]]) -> mx.array:
    cache = make_cache(model)
    model(mx.array([[1, 2, 3]] * len(tokens)), cache=cache)  # a prompt before: the cache holds keys
    out = model(mx.array(tokens), cache=cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_few_tokens_of_one_row_take_one_call_per_group(kind: str) -> None:
    plain, grouped = tiny(kind), tiny(kind)
    counting = Counting()
    assert group_projections(grouped, counting, 32) == 2 * 7
    tokens = [[5, 6, 7, 8, 9]]
    counting.calls.clear()
    assert mx.array_equal(logits(grouped, tokens), logits(plain, tokens)).item()
    # the 5-token forward: q, k and v; o; gate and up; down, in each block (the 3-token
    # prompt before it too)
    assert counting.calls == [3, 1, 2, 1] * 4


@pytest.mark.parametrize("tokens", [[[5]], [[5], [6]], [[5, 6], [7, 8]], [list(range(40))]])
def test_every_other_forward_keeps_the_matmul(tokens: list[list[int]]) -> None:
    """A decode step (one token), batches and forwards past `max_tokens`; the prompt of
    three tokens before them takes the groups only as a lone row's."""
    plain, grouped = tiny(), tiny()
    counting = Counting()
    group_projections(grouped, counting, 32)
    out = logits(grouped, tokens)
    assert mx.array_equal(out, logits(plain, tokens)).item()
    lone_prompt = 4 * 2 if len(tokens) == 1 else 0
    assert len(counting.calls) == lone_prompt


def test_with_batches_a_batchs_few_token_forwards_are_grouped_too() -> None:
    """Two rows of four tokens (a verify round) take the groups; one-token steps of several
    rows and forwards past the limit still do not."""
    plain, grouped = tiny(), tiny()
    counting = Counting()
    group_projections(grouped, counting, 8, batches=True)
    tokens = [[5, 6, 7, 8], [9, 10, 11, 12]]
    out = logits(grouped, tokens)  # the two rows' 3-token prompt (6 rows x tokens) as well
    assert mx.array_equal(out, logits(plain, tokens)).item()
    assert counting.calls == [3, 1, 2, 1] * 4
    counting.calls.clear()
    assert mx.array_equal(logits(grouped, [[5], [6]]), logits(plain, [[5], [6]])).item()
    assert mx.array_equal(logits(grouped, [[5] * 5] * 2), logits(plain, [[5] * 5] * 2)).item()
    assert counting.calls == [3, 1, 2, 1] * 4  # each one's 2 x 3 prompt only: 2 x 5 is past 8


def test_only_plain_float_projections_of_two_byte_dtypes_are_grouped() -> None:
    assert group_projections(tiny(dtype=mx.float32), Counting(), 32) == 0
    assert group_projections(tiny(bits=4), Counting(), 32) == 0  # no quantized matmul given
    assert group_projections(tiny(bits=8), Counting(), 32, quantized=CountingQuantized()) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_4_bit_groups_take_one_call_each_and_stay_quantized_linears(kind: str) -> None:
    """Given a quantized matmul, 4-bit projections group as float ones do: a lone row's
    few-token forwards take one call a group, a decode step keeps the layer's own."""
    plain, grouped = tiny(kind, bits=4), tiny(kind, bits=4)
    counting = CountingQuantized()
    assert group_projections(grouped, Counting(), 32, quantized=counting) == 2 * 7
    q_proj = grouped.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and "biases" in q_proj
    tokens = [[5, 6, 7, 8, 9]]
    assert mx.array_equal(logits(grouped, tokens), logits(plain, tokens)).item()
    assert counting.calls == [3, 1, 2, 1] * 4
    counting.calls.clear()
    assert mx.array_equal(logits(grouped, [[5]]), logits(plain, [[5]])).item()
    assert counting.calls == [3, 1, 2, 1] * 2  # the 3-token prompt only


@pytest.mark.parametrize("bits", [0, 4])
def test_adapters_wrap_the_grouped_projections(bits: int) -> None:
    """A mounted adapter's layer wraps a grouped projection (float or 4-bit) as any other: a
    row on the adapter gets the same logits as over an ungrouped base, a row on none the
    base's, and the few-token projections stay grouped."""
    plain, grouped = tiny(bits=bits), tiny(bits=bits)
    floats, quantized = Counting(), CountingQuantized()
    group_projections(grouped, floats, 32, quantized=quantized)
    counting = quantized if bits else floats
    mx.random.seed(1)
    a = 0.1 * mx.random.normal((64, 8))
    b = 0.1 * mx.random.normal((8, 64))
    layers = []
    for model in (plain, grouped):
        selection = lora.Selection()
        layer = lora.wrap(model, "model.layers.0.self_attn.q_proj", selection)
        layer.put(1, lora.LayerWeights(a, b, 2.0))
        layers.append((selection, layer))
    assert isinstance(layers[1][1].base, FewRowsQuantizedLinear if bits else FewRowsLinear)
    tokens = [[5, 6, 7, 8]]
    for slot in (0, 1):
        for selection, _ in layers:
            selection.set([slot])
        counting.calls.clear()
        ours, theirs = logits(grouped, tokens), logits(plain, tokens)
        assert mx.array_equal(ours, theirs).item()
        assert counting.calls[:4] == [3, 1, 2, 1]
    assert not mx.allclose(ours, logits(tiny(bits=bits), tokens), atol=1e-2).item()  # it acts


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(("rows", "length"), [(1, 2), (1, 9), (1, 32), (2, 5), (4, 8)])
@pytest.mark.parametrize("bits", [0, 4])
def test_the_kernel_gives_the_models_logits(kind: str, rows: int, length: int, bits: int) -> None:
    plain, grouped = tiny(kind, bits=bits), tiny(kind, bits=bits)
    assert fewrows.install(grouped, batches=rows > 1) == 2 * 7
    tokens = [[(7 * i + r) % 50 for i in range(length)] for r in range(rows)]
    ours, theirs = logits(grouped, tokens), logits(plain, tokens)
    err = mx.abs(ours.astype(mx.float32) - theirs.astype(mx.float32)).max().item()
    assert err <= 3e-2 * (1 + mx.abs(theirs).max().item())


@pytest.mark.parametrize("value", [None, "0", "batches"])
def test_the_backend_takes_the_route_on_cuda_only(value: str | None) -> None:
    """On by default on MLX's CUDA build (lone rows; `batches`: a batch's forwards too), off
    with `MLXD_FEW_ROWS=0`, and never elsewhere (no kernel to take)."""
    printed = (
        "from mlxd.engine.attention import cuda_available;"
        " print(b.few_rows, b.few_rows_batches, cuda_available())"
    )
    lone, batches, cuda = backend_says("MLXD_FEW_ROWS", value, printed)
    assert lone == (cuda and value != "0")
    assert batches == (cuda and value == "batches")
