"""A compiled decode step computes what the model's own step does, on the same caches."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import QuantizedKVCache

from mlxd.engine import compiledstep, lora
from mlxd.engine.draftbatch import trim_rows
from mlxd.engine.drafting import ModelDraftSource
from mlxd.engine.kvcache import batch_type, make_cache, set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng, to_ints
from tests.engine.conftest import Loaded
from tests.fixtures.tiny_models import TinyPair

PROMPT = [5, 9, 17, 33, 2, 8, 40, 41, 42, 7]


def _chain(model: Any, cache: list[Any], first: mx.array, steps: int, compiled: bool) -> Any:
    """Each step's logits, greedy tokens fed back without a host read."""
    tok, out = first, []
    for _ in range(steps):
        if compiled:
            assert compiledstep.steps(cache)
            logits = compiledstep.forward(model, cache, tok, compiled=True)[:, -1, :]
        else:
            logits = model(tok, cache=cache)[:, -1, :]
        out.append(logits)
        tok = mx.argmax(logits, axis=-1).reshape(1, 1)
    mx.eval(out)
    return out


@pytest.mark.parametrize("bucket", [None, 16])
def test_compiled_steps_equal_the_models_own(loaded: Loaded, bucket: int | None) -> None:
    """Greedy steps (on 16-key buckets, past three buffer growths): the same logits as the
    model's step; the caches then read more tokens (a catch-up), are trimmed and step on as
    before."""
    model = loaded.draft
    set_bucket(model, bucket)
    try:
        caches = [make_cache(model), make_cache(model)]
        firsts = [feed(model, c, PROMPT) for c in caches]
        tok = mx.argmax(firsts[0], axis=-1).reshape(1, 1)
        steps = 40
        own = _chain(model, caches[0], tok, steps, compiled=False)
        ours = _chain(model, caches[1], tok, steps, compiled=True)
        for a, b in zip(own, ours, strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()
        assert caches[1][0].offset == caches[0][0].offset == len(PROMPT) - 1 + steps + 1
        more = [3, 4, 5]
        for c in caches:
            feed(model, c, more)
            for layer in c:
                layer.trim(2)
        again = [_chain(model, c, tok, 5, compiled=i == 1) for i, c in enumerate(caches)]
        for a, b in zip(*again, strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()
    finally:
        set_bucket(model, None)


def test_only_plain_caches_at_one_offset_step(loaded: Loaded) -> None:
    model = loaded.draft
    cache = make_cache(model)
    assert not compiledstep.steps(cache)  # no buffer yet
    feed(model, cache, PROMPT)
    assert compiledstep.steps(cache)
    shorter = make_cache(model)
    feed(model, shorter, PROMPT[:-1])
    assert not compiledstep.steps([*cache, *shorter])
    assert not compiledstep.steps([QuantizedKVCache() for _ in cache])
    assert not compiledstep.steps([])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_model_proposes_the_same_compiled(loaded: Loaded, temperature: float) -> None:
    """A draft source's chains, compiled or not, propose the same tokens round after round."""
    drafts: list[list[list[int]]] = []
    for compiled in (False, True):
        opts = parse_options({"temperature": temperature, "seed": 11})
        source = ModelDraftSource(loaded.draft, opts, Rng(11))
        source.compiled = compiled
        tokens = list(PROMPT)
        source.prefill(tokens)
        rounds = []
        for i in range(6):
            proposed = to_ints(source.propose(tokens, 4).tokens)
            rounds.append(proposed)
            tokens += [*proposed[: i % 3 + 1], i + 50]  # some accepted, then a correction
            source.accept(tokens)
        drafts.append(rounds)
    assert drafts[0] == drafts[1]


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("1", True), ("on", True), ("0", False), ("off", False)):
        monkeypatch.setenv("MLXD_COMPILED_DRAFT", value)
        assert compiledstep.enabled() is on
    monkeypatch.delenv("MLXD_COMPILED_DRAFT")
    assert not compiledstep.enabled()


@pytest.mark.parametrize("bucket", [None, 16])
def test_a_compiled_forward_of_several_tokens_equals_the_models(
    loaded: Loaded, bucket: int | None
) -> None:
    """A verify round's forward (several tokens, one crossing a buffer's end): every
    position's logits as the model's own forward gives them."""
    model = loaded.target
    set_bucket(model, bucket)
    try:
        own, ours = make_cache(model), make_cache(model)
        for c in (own, ours):
            feed(model, c, PROMPT)
        for tokens in ([3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]):
            block = mx.array([tokens], dtype=mx.uint32)
            a = model(block, cache=own)
            b = compiledstep.forward(model, ours, block, compiled=True)
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-4).item()
    finally:
        set_bucket(model, None)


def test_a_model_with_row_wise_adapters_is_never_compiled(tiny_pair: TinyPair) -> None:
    """Wrapping a projection for adapters (its rows' choices live on the host) turns the
    model's compiled step off for good, traced or not."""
    model = load(str(tiny_pair.draft))[0]
    cache = make_cache(model)
    feed(model, cache, PROMPT)
    tok = mx.array([[3]], dtype=mx.uint32)
    compiledstep.forward(model, cache, tok, compiled=True)
    assert getattr(model, "mlxd_compiled_step", None)  # traced
    path = next(p for p, m in model.named_modules() if p.endswith("q_proj"))
    lora.wrap(model, path, lora.Selection())
    assert getattr(model, "mlxd_compiled_step", None) is False
    compiledstep.forward(model, cache, tok, compiled=True)  # the model's own forward
    assert getattr(model, "mlxd_compiled_step", None) is False
    assert cache[0].offset == len(PROMPT) + 2


@pytest.mark.parametrize("bucket", [None, 16])
def test_a_batch_steps_compiled_as_its_own_forward(loaded: Loaded, bucket: int | None) -> None:
    """Rows of different lengths merged into a batch cache (left padding), stepped one token
    and several, rows then trimmed by different amounts (rolled into their padding): every
    row's logits as the batch cache's own forward gives them."""
    model = loaded.target
    set_bucket(model, bucket)
    try:
        prompts = [PROMPT, PROMPT[:4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
        batches = []
        for _ in range(2):
            lone = [make_cache(model) for _ in prompts]
            for c, p in zip(lone, prompts, strict=True):
                feed(model, c, p)
            kind = batch_type(model)
            batches.append([kind.merge([c[i] for c in lone]) for i in range(len(lone[0]))])
        own, ours = batches
        assert compiledstep.steps(ours)
        rows = len(prompts)
        for width in (1, 1, 3, 1, 5, 1):
            block = mx.array([[20 + width + r for _ in range(width)] for r in range(rows)])
            a = model(block.astype(mx.uint32), cache=own)
            assert compiledstep.steps(ours)
            b = compiledstep.forward(model, ours, block.astype(mx.uint32), compiled=True)
            assert mx.allclose(a, b, atol=1e-4).item()
            if width > 1:
                for cache in (own, ours):
                    trim_rows(cache, [width - 1, 0, width - 2], rows)
        assert [c._idx for c in ours] == [c._idx for c in own]
        assert all(
            mx.array_equal(a.offset, b.offset).item() for a, b in zip(own, ours, strict=True)
        )
    finally:
        set_bucket(model, None)


def test_a_model_steps_compiled_on_every_thread(tiny_pair: TinyPair) -> None:
    """MLX's streams are per thread, and an array left lazy on one fails on another: a model
    stepped compiled on one thread (a probe's) and then on another (a runner's) steps on each,
    with nothing made on the thread that imported the engine."""
    model = load(str(tiny_pair.draft))[0]
    caches = [make_cache(model) for _ in range(3)]
    for c in caches:
        feed(model, c, PROMPT)
        mx.eval([layer.state for layer in c])
    tok = mx.array([[3]], dtype=mx.uint32)
    mx.eval(tok)
    own = model(tok, cache=caches[0])
    mx.eval(own)
    got: list[Any] = []

    def run(cache: list[Any]) -> None:
        try:
            out = compiledstep.forward(model, cache, tok, compiled=True)
            mx.eval(out)
            got.append(out)
        except Exception as exc:  # the assertion below shows it
            got.append(exc)

    for cache in caches[1:]:
        worker = threading.Thread(target=run, args=(cache,))
        worker.start()
        worker.join()
    for out in got:
        assert isinstance(out, mx.array), out
        assert mx.allclose(own, out, atol=1e-5).item()
    assert len(model.mlxd_compiled_step.by_thread) == 2
