"""Speculative decoding is lossless: greedy parity, distribution equality, failure fallback."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine import generation
from mlxd.engine.drafting import (
    Draft,
    DraftGate,
    DraftSource,
    LookupDraftSource,
    ModelDraftSource,
)
from mlxd.engine.generation import Generation
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs, DraftLengthController
from tests.engine.conftest import Loaded

# Costs that make speculation always look worthwhile, so the tests exercise it every round.
CHEAP = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.01)
# A draft step half a target step: a chain goes on only while its drafts look at least 50%
# likely to be accepted, all of them (`DraftGate`)
DEAR = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.5)


def prompts(tokenizer: object, n: int = 50) -> list[list[int]]:
    rnd = random.Random(7)
    words = [
        "def",
        "return",
        "self",
        "value",
        "for",
        "in",
        "range",
        "(",
        ")",
        ":",
        "x",
        "1",
        "\n    ",
    ]
    out = []
    for _ in range(n):
        text = " ".join(rnd.choice(words) for _ in range(rnd.randint(2, 12)))
        out.append(list(tokenizer.encode(text)))  # type: ignore[attr-defined]
    return out


def generate(
    target: nn.Module,
    prompt: Sequence[int],
    opts: SamplingOptions,
    source: DraftSource | None,
    limit: int = 24,
    eos: set[int] | None = None,
) -> tuple[list[int], Generation]:
    controller = DraftLengthController(CHEAP, 4, 0.01) if source is not None else None
    gen = Generation(target, prompt, opts, eos or {0, 2}, limit, Rng(opts.seed), source, controller)
    try:
        gen.prefill()
        return [t for new in gen for t in new], gen
    finally:
        gen.close()


GREEDY = parse_options({"temperature": 0})


@pytest.mark.parametrize("method", ["self", "weak", "lookup"])
def test_greedy_parity_over_50_prompts(loaded: Loaded, method: str) -> None:
    rounds = accepted = 0
    for prompt in prompts(loaded.tokenizer):
        plain, _ = generate(loaded.target, prompt, GREEDY, None)
        source: DraftSource = (
            LookupDraftSource()
            if method == "lookup"
            else ModelDraftSource(
                loaded.target if method == "self" else loaded.draft, GREEDY, Rng(0)
            )
        )
        spec, gen = generate(loaded.target, prompt, GREEDY, source)
        assert spec == plain
        assert gen.stats.fallback_reason is None
        rounds += gen.stats.rounds
        accepted += gen.stats.accepted
    assert rounds > 0
    if method == "self":
        assert accepted > 0.9 * rounds * 1  # a draft equal to the target is almost always right


def test_a_draft_chain_goes_on_only_where_its_next_draft_can_pay() -> None:
    """One more draft is worth a plain step times the chance that it and every draft before
    it are accepted, and costs a draft step plus the verify's growth by one token."""
    flat = DraftGate(DEAR)
    assert flat.goes_on([0.5], 1) and flat.goes_on([0.9], 3)
    assert not flat.goes_on([0.49], 1)
    growing = DraftGate(Costs(verify={1: 1.0, 2: 1.1, 3: 1.4}, draft_step=0.5))
    # a second draft widens the verify from 2 to 3 tokens, 0.3 more: 0.8 of a plain step
    assert growing.goes_on([0.8], 1) and not growing.goes_on([0.79], 1)
    # two rows drafting together: a token is worth half a plain round of two rows (0.5 here),
    # a step of both costs 0.6; the verify grows from 4 to 6 tokens at no cost
    together = DraftGate(replace(DEAR, draft_batch={2: 0.6}))
    assert together.goes_on([0.9, 0.3], 1) and not together.goes_on([0.3, 0.29], 1)


class _Records(DraftSource):
    """A source that keeps each round's (asked for, proposed) counts."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.proposals: list[tuple[int, int]] = []

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        draft = super().propose(tokens, n)
        self.proposals.append((n, draft.count))
        return draft


class _Recording(_Records, ModelDraftSource):
    pass


@pytest.mark.parametrize("drafter", ["self", "weak"])
def test_a_gated_draft_chain_stops_early_and_stays_lossless(loaded: Loaded, drafter: str) -> None:
    """With a draft step half a target step, chains end where the draft doubts its tokens: the
    output is still plain decoding's, and a draft equal to the target (its cache kept in step
    with what it fed) has every draft accepted."""
    model = loaded.target if drafter == "self" else loaded.draft
    cut = rounds = drafted = accepted = 0
    for prompt in prompts(loaded.tokenizer, 12):
        plain, _ = generate(loaded.target, prompt, GREEDY, None)
        source = _Recording(model, GREEDY, Rng(0), DEAR)
        spec, gen = generate(loaded.target, prompt, GREEDY, source)
        assert spec == plain
        assert all(1 <= got <= asked for asked, got in source.proposals)
        cut += sum(got < asked for asked, got in source.proposals)
        rounds += gen.stats.rounds
        drafted += gen.stats.drafted
        accepted += gen.stats.accepted
    assert rounds > 0 and cut > 0
    if drafter == "self":
        assert accepted == drafted


class _RecordingLookup(_Records, LookupDraftSource):
    pass


PENALTIES = parse_options({"temperature": 0, "repeat_penalty": 1.3, "presence_penalty": 0.5})


@pytest.mark.parametrize("opts", [GREEDY, PENALTIES], ids=["pipelined", "penalties"])
def test_rounds_only_where_lookup_has_a_draft(loaded: Loaded, opts: SamplingOptions) -> None:
    """Between prompt-lookup matches the target decodes plainly (pipelined where it can) rather
    than spending a verify round that drafts nothing; the output stays the target's own."""
    asked = 0
    for prompt in prompts(loaded.tokenizer, 20):
        plain, _ = generate(loaded.target, prompt, opts, None, limit=40)
        source = _RecordingLookup()
        spec, gen = generate(loaded.target, prompt, opts, source, limit=40)
        assert spec == plain
        assert all(got > 0 for want, got in source.proposals if want > 0)
        asked += sum(1 for want, _ in source.proposals if want > 0)
        assert gen.stats.rounds == sum(1 for _, got in source.proposals if got > 0)
    assert asked > 0


def reads_and_forwards(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The list that, from now, records each host read (`mx.eval`) of a solo step as "read"
    and each next forward it builds as "next forward", in order."""
    order: list[str] = []
    evaluate, forward_one = generation.mx.eval, Generation._forward_one

    def evaluated(*args: object) -> None:
        order.append("read")
        evaluate(*args)

    def forward(self: Generation, tok: mx.array, position: int) -> mx.array:
        order.append("next forward")
        return forward_one(self, tok, position)

    monkeypatch.setattr(generation.mx, "eval", evaluated)
    monkeypatch.setattr(Generation, "_forward_one", forward)
    return order


def test_a_fresh_step_reads_its_token_before_it_queues_the_next_forward(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's first token (nothing in flight) is on the host before the next forward is
    built: on a GPU, queued first, that forward ran before the token could be read. Later
    steps stay pipelined, and the tokens are plain decoding's."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=12)
    order = reads_and_forwards(monkeypatch)
    gen = Generation(loaded.target, prompt, GREEDY, set(), 12, Rng(0))
    gen.prefill()
    order.clear()
    first = gen.step()
    assert order == ["read", "next forward"]
    rest = [t for new in gen for t in new]
    assert "read" not in order[2:]  # the steps after it read the token queued a step ahead
    assert first + rest == plain


def test_the_token_after_a_round_is_queued_and_the_next_forward_built_before_it_is_read(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a verify round a lone row's plain token is not read before the forward after it
    is queued behind it (the device computes the token while the host builds that forward),
    and the tokens are plain decoding's."""
    plains = {}
    for i, prompt in enumerate(prompts(loaded.tokenizer, 20)):
        plains[i] = generate(loaded.target, prompt, GREEDY, None, limit=40)[0]
    order = reads_and_forwards(monkeypatch)
    speculative_round = Generation._speculative_round

    def round_(self: Generation, k: int) -> list[int]:
        order.append("round")
        new = speculative_round(self, k)
        order.append("round done")
        return new

    monkeypatch.setattr(Generation, "_speculative_round", round_)
    queued_first = 0
    for i, prompt in enumerate(prompts(loaded.tokenizer, 20)):
        order.clear()
        spec, _ = generate(loaded.target, prompt, GREEDY, LookupDraftSource(), limit=40)
        assert spec == plains[i]
        after = [order[j + 1] for j, e in enumerate(order[:-1]) if e == "round done"]
        assert "read" not in after
        queued_first += after.count("next forward")
    assert queued_first > 0


SAMPLED = parse_options({"temperature": 0.8, "seed": 5})


@pytest.mark.parametrize("opts", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_round_is_queued_behind_the_token_in_flight(
    opts: SamplingOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where prompt lookup finds a match while a plainly decoded token is in flight, the round
    verifying its drafts is queued before that token is read (the drafts guessed past the
    token lookup expects), and the output is still plain decoding's: token for token greedy,
    the same seeded samples at 0.8, whether the guess was right or not."""
    target = tiny_vocab_model(3, 6)  # six tokens: its output repeats, and lookup matches it
    rnd = random.Random(3)
    texts = [[rnd.randrange(1, 6) for _ in range(12)] for _ in range(8)]
    plains = [generate(target, p, opts, None, limit=48, eos=set())[0] for p in texts]
    order: list[str] = []
    to_int, async_eval = generation.to_int, generation.mx.async_eval
    round_behind = Generation._round_behind

    def read(a: mx.array) -> int:
        order.append("read")
        return to_int(a)

    def queued(*args: object) -> None:
        order.append("queued")
        async_eval(*args)

    def behind(self: Generation, draft: Draft) -> list[int]:
        order.append("behind")
        return round_behind(self, draft)

    monkeypatch.setattr(generation, "to_int", read)
    monkeypatch.setattr(generation.mx, "async_eval", queued)
    monkeypatch.setattr(Generation, "_round_behind", behind)
    rounds = accepted = 0
    for text, plain in zip(texts, plains, strict=True):
        order.clear()
        spec, gen = generate(target, text, opts, LookupDraftSource(), limit=48, eos=set())
        assert spec == plain
        assert gen.stats.behind == order.count("behind")
        for i, event in enumerate(order):
            if event == "behind":
                assert order[i + 1 : i + 3] == ["queued", "read"]
        rounds += gen.stats.behind
        accepted += gen.stats.accepted
    assert rounds > 0 and accepted > 0


def test_greedy_parity_with_penalties(loaded: Loaded) -> None:
    opts = parse_options(
        {"temperature": 0, "repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2}
    )
    for prompt in prompts(loaded.tokenizer, 8):
        plain, _ = generate(loaded.target, prompt, opts, None)
        spec, _ = generate(
            loaded.target, prompt, opts, ModelDraftSource(loaded.draft, opts, Rng(0))
        )
        assert spec == plain


def test_exact_num_predict(loaded: Loaded) -> None:
    prompt = prompts(loaded.tokenizer, 1)[0]
    for limit in (1, 2, 3, 5, 8, 13):
        source = ModelDraftSource(loaded.target, GREEDY, Rng(0))
        out, gen = generate(loaded.target, prompt, GREEDY, source, limit=limit)
        assert len(out) == limit
        assert gen.finish == "length"


class ProposesEos(DraftSource):
    """A hostile draft: always proposes the token the target will pick... then EOS."""

    name = "eos"

    def __init__(self, inner: ModelDraftSource, eos: int) -> None:
        self.inner = inner
        self.eos = eos

    def prefill(self, tokens: Sequence[int]) -> None:
        self.inner.prefill(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        d = self.inner.propose(tokens, n)
        if d.count < 2:
            return d
        toks = d.tokens.tolist()
        toks[1] = self.eos
        return Draft(mx.array(toks, dtype=mx.uint32), d.count, self.name)

    def accept(self, tokens: Sequence[int]) -> None:
        self.inner.accept(tokens)


def test_eos_draft_is_not_accepted_unless_the_target_agrees(loaded: Loaded) -> None:
    for prompt in prompts(loaded.tokenizer, 10):
        plain, _ = generate(loaded.target, prompt, GREEDY, None)
        source = ProposesEos(ModelDraftSource(loaded.target, GREEDY, Rng(0)), eos=2)
        out, _ = generate(loaded.target, prompt, GREEDY, source)
        assert out == plain
        assert 2 not in out


def test_accepted_eos_ends_generation(loaded: Loaded) -> None:
    """When EOS is the target's choice too, generation ends there (EOS kept for the caller)."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None)
    eos = plain[3]  # pretend the 4th greedy token is an end-of-sequence token
    source = ModelDraftSource(loaded.target, GREEDY, Rng(0))
    out, gen = generate(loaded.target, prompt, GREEDY, source, eos={eos})
    assert out == plain[:4]
    assert gen.finish == "stop"


class Explodes(DraftSource):
    """Works for a few rounds, then raises, as a broken draft model would."""

    name = "explodes"

    def __init__(self, inner: DraftSource, after: int) -> None:
        self.inner = inner
        self.calls = 0
        self.after = after

    def prefill(self, tokens: Sequence[int]) -> None:
        self.inner.prefill(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("draft model exploded")
        return self.inner.propose(tokens, n)

    def accept(self, tokens: Sequence[int]) -> None:
        self.inner.accept(tokens)


@pytest.mark.parametrize("after", [0, 2])
def test_failing_draft_falls_back_to_plain_decoding(loaded: Loaded, after: int) -> None:
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None)
    source = Explodes(ModelDraftSource(loaded.draft, GREEDY, Rng(0)), after)
    out, gen = generate(loaded.target, prompt, GREEDY, source)
    assert out == plain
    assert gen.stats.fallback_reason is not None
    assert "exploded" in gen.stats.fallback_reason


# -- temperature > 0: the emitted distribution is the target's -----------------------------------


def chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def tiny_vocab_model(seed: int, vocab: int) -> nn.Module:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=vocab,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 6.0  # peaked enough to be interesting
    mx.eval(model.parameters())
    return model


def exact_pair_distribution(
    model: nn.Module, prompt: list[int], opts: SamplingOptions, vocab: int
) -> dict[tuple[int, int], float]:
    from mlxd.engine.sampling import probabilities

    first = probabilities(model(mx.array([prompt]))[0, -1:], opts)[0].tolist()
    out = {}
    for a in range(vocab):
        second = probabilities(model(mx.array([[*prompt, a]]))[0, -1:], opts)[0].tolist()
        for b in range(vocab):
            out[(a, b)] = first[a] * second[b]
    return out


@pytest.mark.parametrize("method", ["model", "gated", "lookup"])
def test_sampled_distribution_matches_target(method: str) -> None:
    vocab = 5
    target = tiny_vocab_model(11, vocab)
    draft = tiny_vocab_model(12, vocab)
    prompt = [1, 3, 2, 1, 3]  # repeats, so prompt lookup has something to propose
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    expected = exact_pair_distribution(target, prompt, parse_options(base), vocab)
    counts: Counter[tuple[int, int]] = Counter()
    trials = 1500
    drafted = cut = 0
    for seed in range(trials):
        opts = parse_options({**base, "seed": seed})
        rng = Rng(seed)
        source: DraftSource = (
            LookupDraftSource(2, 1)
            if method == "lookup"
            else ModelDraftSource(draft, opts, rng, DEAR if method == "gated" else None)
        )
        controller = DraftLengthController(CHEAP, 2, 0.01)
        gen = Generation(target, prompt, opts, set(), 3, rng, source, controller)
        gen.prefill()
        out = [t for new in gen for t in new]
        drafted += gen.stats.drafted
        part = source.model_part()
        cut += part.cut if part is not None else 0
        gen.close()
        counts[(out[0], out[1])] += 1
    # two drafts in the first round of every trial; gated, the first at least, and some chains
    # end there
    assert drafted >= (trials if method == "gated" else 2 * trials)
    assert (cut > 0) == (method == "gated")
    stat, df = 0.0, 0
    for cell, p in expected.items():
        e = p * trials
        if e >= 5:
            stat += (counts[cell] - e) ** 2 / e
            df += 1
    assert chi2_pvalue(stat, df - 1) > 1e-3, (stat, df)


def test_sampled_acceptance_beats_exact_match(loaded: Loaded) -> None:
    """min(1, p/q) accepts more than "draft equals the target's own sample" would."""
    from mlxd.engine.sampling import probabilities

    opts = parse_options({"temperature": 0.8, "top_k": 0, "top_p": 1.0})
    prompt = prompts(loaded.tokenizer, 1)[0]
    p = probabilities(loaded.target(mx.array([prompt]))[0, -1:], opts)[0]
    q = probabilities(loaded.draft(mx.array([prompt]))[0, -1:], opts)[0]
    ours = float(mx.sum(mx.minimum(p, q)))  # P(accept) under speculative sampling
    exact = float(mx.sum(p * q))  # P(independent samples agree)
    assert ours >= exact


def test_paused_speculation_resumes_and_stays_lossless(loaded: Loaded) -> None:
    """A clock that says speculation never pays pauses it (plain decoding for a while, then a
    retry with a longer pause); the output is still exactly plain decoding's."""
    hopeless = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.0, plain_step=1e-9)
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=96)
    controller = DraftLengthController(
        hopeless, 3, 0.0, patience=2, pause_tokens=4, max_pause=8
    )  # pauses that end within the request, not ones that repay the trials' losses
    source = ModelDraftSource(loaded.draft, GREEDY, Rng(0))
    gen = Generation(loaded.target, prompt, GREEDY, {0, 2}, 96, Rng(0), source, controller)
    try:
        gen.prefill()
        out = [t for new in gen for t in new]
    finally:
        gen.close()
    assert out == plain
    assert gen.stats.paused >= 2  # paused, resumed, paused again
    assert controller.pause_tokens > 4  # each pause longer than the last
    assert gen.stats.rounds > 2 * 2  # it did speculate again after resuming
