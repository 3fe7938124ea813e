"""Batched single-token attention without a mask reads each row's own keys, and only those."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine import attention
from mlxd.engine.attention import (
    attend_with_ops,
    cuda_available,
    install_batched_decode,
    ragged_cuda,
    ragged_reference,
    route_module,
    warming,
)
from mlxd.engine.kvcache import BucketedBatchKVCache, BucketedKVCache, make_cache
from mlxd.engine.prefill import feed
from tests.engine.conftest import Loaded

LENGTHS = [3, 17, 9, 1]


def left_padded(rows: int, heads: int, kv_heads: int, dim: int, dtype: mx.Dtype) -> tuple[Any, ...]:
    """Random q, key/value buffers with garbage in the padding, and each row's left padding."""
    mx.random.seed(rows * dim)
    end = 24
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    k = (mx.random.normal((rows, kv_heads, 32, dim)) * 3).astype(dtype)
    v = mx.random.normal((rows, kv_heads, 32, dim)).astype(dtype)
    left = mx.array([end - n for n in LENGTHS[:rows]])
    return q, k, v, left, end


def masked(q: mx.array, k: mx.array, v: mx.array, left: mx.array, end: int) -> mx.array:
    cols = mx.arange(k.shape[2])[None, None, None, :]
    mask = (cols >= left[:, None, None, None]) & (cols < end)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)


def test_reference_equals_the_masked_attention() -> None:
    q, k, v, left, end = left_padded(4, 4, 2, 16, mx.float32)
    got = ragged_reference(q, k, v, 0.25, left, end)
    assert got.shape == q.shape
    assert mx.allclose(got, masked(q, k, v, left, end), atol=1e-5).item()


def rows_cache(loaded: Loaded, prompts: list[list[int]]) -> list[BucketedBatchKVCache]:
    solo = [make_cache(loaded.target) for _ in prompts]
    for cache, prompt in zip(solo, prompts, strict=True):
        feed(loaded.target, cache, prompt)
    assert isinstance(solo[0][0], BucketedKVCache)
    return [BucketedKVCache.merge([c[i] for c in solo]) for i in range(len(solo[0]))]


@pytest.mark.usefixtures("gpu_layout")
def test_routed_batch_step_matches_the_masked_one(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step over rows of different lengths gives the same logits routed or masked;
    prefill and solo decoding never reach the routed attention."""
    module = sys.modules[type(loaded.target).__module__]
    monkeypatch.setattr(module, "scaled_dot_product_attention", module.scaled_dot_product_attention)
    prompts = [[5 + i + j for j in range(n)] for i, n in enumerate(LENGTHS)]
    step = mx.array([[7], [8], [9], [10]])
    want = loaded.target(step, cache=rows_cache(loaded, prompts))

    calls: list[int] = []

    def spy(*args: Any) -> mx.array:
        calls.append(args[0].shape[0])
        return ragged_reference(*args)

    assert route_module(module, spy, lambda _dim: True)
    cache = rows_cache(loaded, prompts)
    assert calls == []  # prompts are read on the usual path
    got = loaded.target(step, cache=cache)
    assert calls == [4] * len(cache)
    assert mx.allclose(got, want, atol=1e-4).item()
    solo = make_cache(loaded.target)
    feed(loaded.target, solo, prompts[0])
    loaded.target(mx.array([[7]]), cache=solo)
    assert calls == [4] * len(cache)


def test_routing_twice_keeps_one_hook(loaded: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    module = sys.modules[type(loaded.target).__module__]
    # Where the ragged kernel runs (CUDA), loading has routed the module already.
    routed = module.scaled_dot_product_attention
    original = getattr(routed, "__wrapped__", routed)
    monkeypatch.setattr(module, "scaled_dot_product_attention", original)
    route_module(module, ragged_reference, lambda _dim: True)
    route_module(module, ragged_reference, lambda _dim: True)
    assert module.scaled_dot_product_attention.__wrapped__ is original


def test_installing_routes_models_imported_before_and_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The configuration installs the route once: every model module already imported, and
    mlx-lm's base function, which model modules imported later bind; twice changes nothing."""
    from mlx_lm.models import base, llama

    later = "mlx_lm.models.gemma"
    monkeypatch.delitem(sys.modules, later, raising=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and hasattr(module, "scaled_dot_product_attention"):
            original = module.scaled_dot_product_attention
            monkeypatch.setattr(module, "scaled_dot_product_attention", original)
    unrouted = llama.scaled_dot_product_attention
    install_batched_decode(ragged_reference, lambda _dim: True)
    install_batched_decode(ragged_reference, lambda _dim: True)
    gemma = importlib.import_module(later)
    try:
        for module in (base, llama, gemma):
            routed = module.scaled_dot_product_attention
            assert routed.__wrapped__ is base.scaled_dot_product_attention.__wrapped__
            assert not hasattr(routed.__wrapped__, "__wrapped__")  # one hook, however often
        assert llama.scaled_dot_product_attention.__wrapped__ is getattr(
            unrouted, "__wrapped__", unrouted
        )
    finally:
        sys.modules.pop(later, None)  # imported routed: the next import starts afresh


@pytest.mark.skipif(not cuda_available(), reason="the kernel runs on MLX's CUDA build")
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_kernel_equals_the_reference(dim: int, dtype: mx.Dtype) -> None:
    q, k, v, left, end = left_padded(4, 8, 2, dim, dtype)
    got = ragged_cuda(q, k, v, 0.25, left, end).astype(mx.float32)
    want = ragged_reference(q, k, v, 0.25, left, end).astype(mx.float32)
    assert mx.allclose(got, want, atol=2e-2 if dtype == mx.bfloat16 else 1e-4).item()


@pytest.mark.parametrize("rows", [1, 3])
def test_attention_with_operations_equals_mlx_attention(rows: int) -> None:
    """Grouped heads, a few queries, a mask of a batch's rows (left padding, causal) or of a
    lone row (queries x keys)."""
    mx.random.seed(rows)
    q = mx.random.normal((rows, 8, 3, 16))
    k, v = mx.random.normal((rows, 2, 24, 16)), mx.random.normal((rows, 2, 24, 16))
    cols = mx.arange(24)[None, None, None, :]
    ends = (mx.arange(3) + 18)[None, None, :, None]
    left = mx.array([2 * i for i in range(rows)])[:, None, None, None]
    mask = (cols <= ends) & (cols >= left)
    if rows == 1:
        mask = mask[0, 0]  # (queries, keys), as a lone row's cache makes it
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = attend_with_ops(q, k, v, 0.25, mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.usefixtures("gpu_layout")
def test_multi_token_shapes_warm_up_did_not_run_take_the_operations(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any warm-up every call keeps MLX's attention; after one, a verify-wide forward
    of a shape it ran keeps it too, and one of a shape it did not run takes the operations,
    with the same logits."""
    module = sys.modules[type(loaded.target).__module__]
    monkeypatch.setattr(module, "scaled_dot_product_attention", module.scaled_dot_product_attention)
    monkeypatch.setattr(attention, "_warmed", attention._Warmed())
    prompt = [5, 6, 7, 8, 9, 10, 11]

    def verify(width: int) -> mx.array:
        cache = make_cache(loaded.target)
        feed(loaded.target, cache, prompt)
        return loaded.target(mx.array([[3 + i for i in range(width)]]), cache=cache)

    want = {width: verify(width) for width in (3, 5)}
    taken: list[int] = []

    def spy(q: mx.array, *args: Any) -> mx.array:
        taken.append(q.shape[2])
        return attend_with_ops(q, *args)

    assert route_module(module, ragged_reference, lambda _dim: True)
    monkeypatch.setattr(attention, "attend_with_ops", spy)
    layers = len(loaded.target.layers)
    assert mx.allclose(verify(3), want[3], atol=1e-4).item() and taken == []
    with warming():
        verify(3)
    assert taken == []
    assert mx.allclose(verify(3), want[3], atol=1e-4).item() and taken == []
    assert mx.allclose(verify(5), want[5], atol=1e-4).item()
    assert taken == [5] * layers


@pytest.mark.usefixtures("gpu_layout")
def test_a_verify_forwards_boolean_mask_is_made_additive_once(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer of a multi-token forward over a bucketed cache gets the same mask; routed,
    it is converted to 0 / -inf once and the logits are those of the boolean mask."""
    module = sys.modules[type(loaded.target).__module__]
    monkeypatch.setattr(module, "scaled_dot_product_attention", module.scaled_dot_product_attention)
    monkeypatch.setattr(attention, "_warmed", attention._Warmed())
    prompt = [5, 6, 7, 8, 9, 10, 11]

    def verify() -> mx.array:
        cache = make_cache(loaded.target)
        feed(loaded.target, cache, prompt)
        return loaded.target(mx.array([[3, 4, 5, 6]]), cache=cache)

    want = verify()
    made: list[mx.Dtype] = []
    convert = attention.additive

    def spy(mask: mx.array, dtype: mx.Dtype) -> mx.array:
        made.append(dtype)
        return convert(mask, dtype)

    monkeypatch.setattr(attention, "additive", spy)
    assert route_module(module, ragged_reference, lambda _dim: True)
    assert mx.array_equal(verify(), want).item()
    # every layer of the prompt's forward and of the verify's asks; `additive` converts once
    assert len(made) == 2 * len(loaded.target.layers)
    mask = mx.array([[True, False], [True, True]])
    first = convert(mask, mx.float32)
    assert convert(mask, mx.float32) is first
    assert first.tolist() == [[0.0, -mx.inf], [0.0, 0.0]]
