"""A lone row's next verify round queued on a guess before the round in flight is read
(`engine.guessing`): the tokens stay plain decoding's, a guess that fails leaves the cache as
if it had never been queued, and the measured costs decide whether to guess at all."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from mlxd.engine import branches, guessing
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import make_cache, set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import Pairing
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng
from mlxd.engine.scheduler import make_draft_source
from mlxd.engine.speculation import Costs
from tests.engine.conftest import FLAT, GPU_TEST_BUCKET, PIECES

# a lone forward waits a whole step for the device, at every width: what a queued round saves
# is all of a step, and a failed guess costs nothing the host would not have idled through
WAITING = Costs(verify={w: 2.0 for w in range(1, 40)}, plain_step=1.0)
OPTIONS = [{}, {"temperature": 0.7, "seed": 3}]


@pytest.fixture(params=[None, GPU_TEST_BUCKET], ids=["exact", "bucketed"])
def waiting(
    request: pytest.FixtureRequest, copier: Pairing, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pairing]:
    """The copier on a device where guessing pays, with exact caches and with a GPU's."""
    monkeypatch.setattr(copier, "costs", WAITING)
    set_bucket(copier.target, request.param)
    try:
        yield copier
    finally:
        set_bucket(copier.target, None)


def row(pairing: Pairing, prompt: list[int], limit: int, **options: object) -> Generation:
    opts = parse_options({"temperature": 0, **options})
    source, controller = make_draft_source(pairing, opts, Rng(0))
    gen = Generation(
        pairing.target, prompt, opts, pairing.eos_ids, limit, Rng(0), source, controller
    )
    gen.prefill()
    return gen


def decoded(pairing: Pairing, prompt: list[int], method: str, **options: object) -> Generation:
    gen = row(pairing, prompt, len(PIECES) + 1, draft_method=method, **options)
    for _ in gen:
        pass
    return gen


def encode(pairing: Pairing, text: str) -> list[int]:
    return list(pairing.tokenizer.encode(text, add_special_tokens=False))


def assert_cache_holds(gen: Generation, tokens: list[int]) -> None:
    """The row's target cache equals a fresh prefill of `tokens`."""
    fresh = make_cache(gen.target)
    feed(gen.target, fresh, tokens)
    assert gen.cached_tokens == len(tokens)
    for ours, theirs in zip(gen.cache, fresh, strict=True):
        k, v = ours.state[:2]
        k2, v2 = theirs.state[:2]
        n = len(tokens)
        assert mx.allclose(k[..., :n, :], k2[..., :n, :], atol=1e-4).item()
        assert mx.allclose(v[..., :n, :], v2[..., :n, :], atol=1e-4).item()


@pytest.mark.parametrize("options", OPTIONS)
def test_a_copied_span_is_verified_in_queued_rounds(
    waiting: Pairing, options: dict[str, object]
) -> None:
    prompt = encode(waiting, "@" + "".join(PIECES) + "@")
    plain = decoded(waiting, prompt, "off", **options)
    looked = decoded(waiting, prompt, "lookup", **options)
    assert looked.tokens == plain.tokens
    assert looked.stats.guesses_kept >= 1  # a round was read after the next one was queued
    assert looked.stats.accepted > len(PIECES) // 2


@pytest.mark.parametrize("options", OPTIONS)
def test_a_failed_guess_leaves_the_cache_as_plain_decoding_does(
    waiting: Pairing, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The latest occurrence of the prompt's last n-gram went on with "jjjj", which the model
    does not write: lookup's drafts (one branch) and the guess after them fail, and the queued
    round comes off the cache unread."""
    monkeypatch.setattr(branches, "MAX_BRANCHES", 1)
    text = "@" + "".join(PIECES[:12]) + "x" + "".join(PIECES[1:5]) + "jjjj@" + "".join(PIECES[:5])
    prompt = encode(waiting, text)
    plain = decoded(waiting, prompt, "off", **options)
    gen = row(waiting, prompt, len(PIECES) + 1, draft_method="lookup", **options)
    try:
        while not gen.done:
            gen.step()
            if not gen.done and gen._guessed is None and gen._inflight is None:
                assert_cache_holds(gen, gen.tokens[:-1])
        assert gen.tokens == plain.tokens
        assert gen.stats.guesses > gen.stats.guesses_kept
    finally:
        gen.close()


def test_a_row_joining_a_batch_takes_its_queued_round_back(waiting: Pairing) -> None:
    prompt = encode(waiting, "@" + "".join(PIECES) + "@")
    plain = decoded(waiting, prompt, "off")
    gen = row(waiting, prompt, len(PIECES) + 1, draft_method="lookup")
    try:
        while gen._guessed is None and not gen.done:
            gen.step()
        assert gen._guessed is not None
        gen.settle()
        assert gen._guessed is None
        assert_cache_holds(gen, gen.tokens[:-1])
        for _ in gen:
            pass
        assert gen.tokens == plain.tokens
    finally:
        gen.close()


def test_where_a_lone_forward_waits_for_nothing_no_round_is_guessed(copier: Pairing) -> None:
    prompt = encode(copier, "@" + "".join(PIECES) + "@")
    gen = decoded(copier, prompt, "lookup")
    assert gen.stats.drafted > 0
    assert gen.stats.guesses == 0


def test_the_guess_is_priced_by_the_wait_it_saves() -> None:
    assert not guessing.pays(FLAT, 0.99, 9)  # no wait to save
    assert guessing.pays(WAITING, 0.01, 9)  # nothing to lose
    # a lone forward 1.3 steps, 9 tokens 1.8: saves 0.3 a round, a failure costs 1.2
    gpu = Costs(verify={1: 1.3, 9: 1.8}, plain_step=1.0)
    assert guessing.pays(gpu, 0.85, 9)
    assert not guessing.pays(gpu, 0.75, 9)
    assert guessing.pipelined(gpu, 9) == pytest.approx(1.5)
    assert guessing.pipelined(gpu, 1) == 1.0


def test_the_mode_overrides_the_price(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guessing, "MODE", "0")
    assert not guessing.pays(WAITING, 1.0, 2)
    monkeypatch.setattr(guessing, "MODE", "1")
    assert guessing.pays(FLAT, 0.0, 2)
