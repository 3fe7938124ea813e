"""The floor: a draft source that does not pay is paused or dropped within a few rounds, pays
nothing while it is, and never changes a token."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlxd.engine import batch as batch_module
from mlxd.engine.batch import (
    RETRY_ROUNDS,
    Committed,
    RoundTimes,
    RowBatch,
    draft_seconds,
    plan_widths,
)
from mlxd.engine.drafting import Draft, DraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng
from mlxd.engine.specstate import Mode
from mlxd.engine.speculation import Costs, DraftLengthController, FixedDraftLength
from tests.engine.conftest import Loaded
from tests.engine.test_speculative import generate, prompts, tiny_vocab_model

GREEDY = parse_options({"temperature": 0})
# Every verify position costs a tenth of a step more: a round that commits one token loses.
SLOPED = Costs(verify={w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}, plain_step=1.0)
PATIENCE = 4


def _wrong(
    reference: Sequence[int], vocab: int, tokens: Sequence[int], start: int, n: int
) -> list[int]:
    """n tokens, the first of which is never the target's next token."""
    at = len(tokens) - start
    return [(reference[at] + 1) % vocab] * n


class _AlwaysRejected(DraftSource):
    """Drafts that the target rejects at their first token, every round."""

    name = "rejected"

    def __init__(self, reference: list[int], start: int, vocab: int) -> None:
        self.reference, self.start, self.vocab = reference, start, vocab
        self.rounds = 0

    def prefill(self, tokens: Sequence[int]) -> None:
        pass

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self.rounds += 1
        out = _wrong(self.reference, self.vocab, tokens, self.start, n)
        return Draft(mx.array(out, dtype=mx.uint32), n, self.name)

    def accept(self, tokens: Sequence[int]) -> None:
        pass


class _RejectedModel(ModelDraftSource):
    """A real draft model (its cache, its catch-up) whose proposals are always rejected."""

    def __init__(self, loaded: Loaded, reference: list[int], start: int) -> None:
        super().__init__(loaded.draft, GREEDY, Rng(0))
        self.reference, self.start = reference, start
        self.vocab = loaded.target.args.vocab_size
        self.read: list[int] = []

    def prefill(self, tokens: Sequence[int]) -> None:
        self.read.append(len(tokens) - len(self.cached))
        super().prefill(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self.read.append(len(tokens) - len(self.cached))
        drafted = super().propose(tokens, n)  # the draft model runs (and its cache advances)
        out = _wrong(self.reference, self.vocab, tokens, self.start, drafted.count)
        self._drafts = mx.array(out, dtype=mx.uint32)
        return Draft(self._drafts, drafted.count, self.name)


def _run(
    loaded: Loaded, prompt: list[int], source: DraftSource, limit: int
) -> tuple[list[int], Generation]:
    # pauses held short (a lost trial's repayment would outlast these requests)
    controller = DraftLengthController(
        SLOPED, 4, 0.0, patience=PATIENCE, pause_tokens=8, max_pause=16
    )
    gen = Generation(loaded.target, prompt, GREEDY, set(), limit, Rng(0), source, controller)
    try:
        gen.prefill()
        return [t for new in gen for t in new], gen
    finally:
        gen.close()


def test_always_rejected_drafts_pause_within_patience_and_change_nothing(loaded: Loaded) -> None:
    """Fast forwards on this machine make every round look cheap by the wall clock; the cost
    model at the acceptance the rounds really had (one token per round) says they lose, so the
    source pauses after `patience` rounds, each trial after a pause is as short, and every
    token is plain decoding's."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=96)
    source = _AlwaysRejected(plain, len(prompt), loaded.target.args.vocab_size)
    out, gen = _run(loaded, prompt, source, limit=96)
    assert out == plain
    assert gen.stats.accepted == 0
    assert gen.stats.paused >= 2
    # pauses of 16 tokens: at most a few trials of `patience` rounds each
    assert gen.stats.rounds <= PATIENCE * (gen.stats.paused + 1)


def test_a_paused_row_decodes_as_lean_as_one_that_never_drafted(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While paused, a greedy row's tokens go through the same lean step (forward and choice,
    nothing else between tokens) as a row with speculation off; the pause still counts down
    and ends in trials, and the tokens are plain decoding's."""
    lean = Generation._lean_step
    calls = []

    def counted(self: Generation, y: mx.array) -> list[int]:
        calls.append(self.spec.mode)
        return lean(self, y)

    monkeypatch.setattr(Generation, "_lean_step", counted)
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=96)
    source = _AlwaysRejected(plain, len(prompt), loaded.target.args.vocab_size)
    out, gen = _run(loaded, prompt, source, limit=96)
    assert out == plain
    assert gen.stats.paused >= 2 and gen.stats.rounds > PATIENCE  # paused, then tried again
    paused = calls.count(Mode.PAUSED)
    # every paused token but the first and last of each pause (the last pause may end OFF)
    assert paused + calls.count(Mode.OFF) >= 96 - gen.stats.rounds - 2 * gen.stats.paused
    assert paused > gen.stats.paused


def test_a_paused_draft_model_that_would_catch_up_too_much_ends_off(loaded: Loaded) -> None:
    """A draft model reads nothing while paused; when the pause ends, reading what it missed
    would cost more than the rest of the request can repay, so speculation ends for the
    request instead: no catch-up is paid, and the tokens are plain decoding's."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    source = _RejectedModel(loaded, plain, len(prompt))
    out, gen = _run(loaded, prompt, source, limit=48)
    assert out == plain
    assert gen.spec.mode is Mode.OFF and gen.source is None
    assert gen.stats.rounds == PATIENCE and gen.stats.paused == 1
    assert gen.stats.disabled_reason == "speculation paused: catching the draft up would not pay"
    # it read the prompt, then only what each round needed: never the pause's tokens
    assert source.read[0] == len(prompt) and max(source.read[1:]) <= 2


def test_a_long_request_resumes_a_paused_draft_model(loaded: Loaded) -> None:
    """Where the rest of the request is long enough to repay the catch-up, the trial runs."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=160)
    source = _RejectedModel(loaded, plain, len(prompt))
    out, gen = _run(loaded, prompt, source, limit=160)
    assert out == plain
    assert gen.stats.paused >= 2 and gen.stats.rounds > PATIENCE  # it tried again
    assert max(source.read[1:]) >= 8  # ... after reading the first pause's tokens


def test_the_cost_model_stops_rounds_the_wall_clock_calls_cheap() -> None:
    """Rounds that commit one token each lose under the measured cost curve, however fast the
    wall clock saw them; judged by the wall clock alone they would run on."""
    judged = DraftLengthController(SLOPED, 4, 0.0)
    clock_only = DraftLengthController(SLOPED, 4, 0.0)
    for _ in range(judged.patience):
        judged.observe_time(1e-6, 1, drafted=3, arm="lookup")
        clock_only.observe_time(1e-6, 1)
    assert judged.off and not clock_only.off


def test_with_the_floor_off_a_losing_source_keeps_drafting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`MLXD_SPEC_FLOOR=0`: the same losing rounds stop nothing (nor does a pause in history)."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    kept = DraftLengthController(SLOPED, 4, 0.0)
    for _ in range(4 * kept.patience):
        kept.observe_time(1e-6, 1, drafted=3, arm="lookup")
    assert not kept.off


def test_auto_drops_its_draft_model_arm_when_that_arm_loses() -> None:
    """Free lookup rounds that win big must not hide draft-model rounds that lose: the model
    arm is judged on its own rounds, and `auto` continues with lookup alone."""
    costs = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.3, plain_step=1.0)
    ctl = DraftLengthController(costs, 4, 0.3, source="auto")
    rounds = 0
    while not ctl.off and rounds < 40:
        ctl.observe_time(0.5, 5, drafted=4, arm="lookup")  # 10x plain
        ctl.observe_time(2.0, 1, drafted=3, arm="model")  # half as fast as plain
        rounds += 1
        assert ctl.clock.slower(costs.plain, ctl.floor) < 1.0  # the mix pays throughout
    assert ctl.off and rounds <= ctl.patience


def _rejected_rows(
    loaded: Loaded, costs: Costs, limit: int, pause_tokens: int, prior: float = 0.7
) -> tuple[list[Generation], list[list[int]]]:
    """Three prefilled greedy rows whose drafts are always rejected, and their plain tokens
    (`prior`: the acceptance their controllers expect before they have seen any)."""
    texts = prompts(loaded.tokenizer, 3)
    plains = [generate(loaded.target, p, GREEDY, None, limit=limit)[0] for p in texts]
    gens = []
    for prompt, plain in zip(texts, plains, strict=True):
        source = _AlwaysRejected(plain, len(prompt), loaded.target.args.vocab_size)
        controller = DraftLengthController(
            costs, 4, 0.0, prior=prior, patience=PATIENCE, pause_tokens=pause_tokens
        )
        gen = Generation(loaded.target, prompt, GREEDY, set(), limit, Rng(0), source, controller)
        gen.prefill()
        gens.append(gen)
    return gens, plains


def _batched(loaded: Loaded, costs: Costs, gens: list[Generation]) -> tuple[list[list[int]], int]:
    """Every row's tokens from batch rounds until all are done, and how many rounds left a
    round queued ahead."""
    batch = RowBatch(loaded.target, costs)
    batch.join(gens)
    out: list[list[int]] = [[] for _ in gens]
    queued = 0
    while len(batch):
        for c in batch.round():
            out[gens.index(c.gen)] += c.tokens
        queued += batch.ahead is not None
        for g in [g for g in batch.gens if g.done]:
            batch.leave(g)
    return out, queued


def test_batched_rows_whose_drafts_lose_pause_as_alone(loaded: Loaded) -> None:
    """In a batch each drafting row's controller judges the rounds too: rows whose drafts are
    always rejected pause within the patience, and every row keeps plain decoding's tokens."""
    gens, plains = _rejected_rows(loaded, SLOPED, 64, pause_tokens=8)
    out, _ = _batched(loaded, SLOPED, gens)
    assert out == plains
    for g in gens:  # at most `patience` losing rounds per trial
        assert g.stats.accepted == 0 and g.stats.paused >= 1
        assert g.stats.rounds <= PATIENCE * (g.stats.paused + 1)
        g.close()


def test_a_batch_judges_drafts_by_what_the_whole_batch_commits(loaded: Loaded) -> None:
    """A row whose drafts win for itself but make its batch-mates pay a wider forward is
    judged a loser: the round's time is shared out per token the batch committed."""
    costs = Costs(verify={1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}, plain_step=1.0)
    texts = prompts(loaded.tokenizer, 4)
    gens = [Generation(loaded.target, p, GREEDY, set(), 16, Rng(0)) for p in texts]
    controller = DraftLengthController(costs, 4, 0.0, patience=PATIENCE)
    gens[0] = Generation(
        loaded.target, texts[0], GREEDY, set(), 16, Rng(0), _AlwaysRejected([], 0, 9), controller
    )
    batch = RowBatch(loaded.target, costs)
    batch.gens = gens
    drafts = [Draft(mx.array([1], dtype=mx.uint32), 1, "rejected")] + [Draft.empty()] * 3
    committed = [Committed(gens[0], [5, 6])] + [Committed(g, [7]) for g in gens[1:]]
    drafting = draft_seconds(gens, [1, 0, 0, 0], costs)  # a draft_cost of 0: nothing
    batch._judge(drafts, committed, seconds=3.0, width=2, drafting=drafting)
    # a plain round of 4 rows: 4 tokens in v(4) = 2.0, so a token's plain share is 0.5 s;
    # this round committed 5 tokens in 3.0 s: 0.6 s each, 1.2 s for the row's 2 tokens
    share = 4 * 1.0 / 2.0 / 5 * 2
    assert controller.clock.seconds == pytest.approx(3.0 * share)
    assert controller.clock.modelled == pytest.approx(costs.v(8) * share)
    assert controller.clock.slower(costs.plain, 1.0) > 1.0  # alone it would look 1.33x faster


def test_rows_a_batch_never_lets_draft_pause_and_decode_pipelined(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the measured costs say no draft pays in the batch (every verify token costs a
    step, as on a CPU), rows that keep wanting drafts pause within the patience: their
    source stops running, and the batch's rounds are pipelined plain rounds throughout."""
    linear = Costs(verify={w: float(w) for w in range(1, 17)}, plain_step=1.0)
    gens, plains = _rejected_rows(loaded, linear, 40, pause_tokens=64)
    verifies = []
    propose = RowBatch._propose

    def counted(self: RowBatch, ks: list[int]) -> list[Draft]:
        verifies.append(ks)
        return propose(self, ks)

    monkeypatch.setattr(RowBatch, "_propose", counted)
    out, queued = _batched(loaded, linear, gens)
    assert out == plains
    for g in gens:
        assert g.stats.rounds == 0 and g.stats.paused == 1 and g.source.rounds == 0
        g.close()
    # every round after the first ran ahead: rows the plan declines are benched without
    # costing the batch its pipelining while they still want drafts
    assert queued >= 40 - 1
    assert verifies == []  # declined rounds are plain rounds: no verify forward


def test_a_pause_that_ends_into_a_declined_round_keeps_the_batch_pipelined(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows whose short pauses end again and again, in a batch whose measured costs decline
    every draft: the round where a pause ends is priced ahead like any other, so it is queued
    ahead too and the batch never runs a round unpipelined."""
    linear = Costs(verify={w: float(w) for w in range(1, 17)}, plain_step=1.0)
    gens, plains = _rejected_rows(loaded, linear, 48, pause_tokens=2)
    ended = []
    resume = DraftLengthController.resume

    def counted(self: DraftLengthController) -> None:
        ended.append(self)
        resume(self)

    monkeypatch.setattr(DraftLengthController, "resume", counted)
    out, queued = _batched(loaded, linear, gens)
    assert out == plains
    assert len(ended) >= 3  # pauses did end, into rounds the plan declined
    assert queued >= 48 - 1
    for g in gens:
        assert g.stats.rounds == 0
        g.close()


class ReferenceDrafts(DraftSource):
    """Drafts of the reference continuation (no model state to catch up after a pause), then
    nothing to propose for the next `gap` tokens."""

    name = "model"

    def __init__(self, reference: list[int], start: int, gap: int = 0) -> None:
        self.reference, self.start, self.gap = reference, start, gap
        self.next_at = 0

    def prefill(self, tokens: Sequence[int]) -> None:
        pass

    def has_draft(self, tokens: Sequence[int]) -> bool:
        return len(tokens) >= self.next_at

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self.next_at = len(tokens) + self.gap
        at = len(tokens) - self.start
        out = self.reference[at : at + n]
        return Draft(mx.array(out, dtype=mx.uint32), len(out), self.name)

    def accept(self, tokens: Sequence[int]) -> None:
        pass


def test_a_verify_round_queues_the_plain_round_after_it(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that draft now and then: a verify round followed by a round where every row
    decodes plainly queues that round before returning, as a plain round does, so no plain
    round runs unqueued after the first; every row keeps plain decoding's tokens."""
    flat = Costs(verify=dict.fromkeys(range(1, 40), 1.0), plain_step=1.0)
    texts = prompts(loaded.tokenizer, 3)
    plains = [generate(loaded.target, p, GREEDY, None, limit=40)[0] for p in texts]
    gens = []
    for prompt, plain in zip(texts, plains, strict=True):
        source = ReferenceDrafts(plain, len(prompt), gap=7)
        gen = Generation(
            loaded.target, prompt, GREEDY, set(), 40, Rng(0), source, FixedDraftLength(flat, 3)
        )
        gen.prefill()
        gens.append(gen)
    verifies, unqueued = [], []
    propose, plain_round = RowBatch._propose, RowBatch._plain_round

    def counted(self: RowBatch, ks: list[int]) -> list[Draft]:
        verifies.append(ks)
        return propose(self, ks)

    def plain(self: RowBatch, since: float | None = None) -> list[Committed]:
        unqueued.append(self.ahead is None)
        return plain_round(self, since)

    monkeypatch.setattr(RowBatch, "_propose", counted)
    monkeypatch.setattr(RowBatch, "_plain_round", plain)
    # rounds priced by the flat costs alone: a round timed slow on a loaded machine would
    # otherwise have the plan decline drafts the round before expected
    monkeypatch.setattr(RoundTimes, "add_plain", lambda *a: None)
    monkeypatch.setattr(RoundTimes, "add_verify", lambda *a: None)
    out, _ = _batched(loaded, flat, gens)
    assert out == plains
    assert len(verifies) >= 3 and unqueued and not any(unqueued[1:])
    for g in gens:
        assert g.stats.accepted > 0
        g.close()


class _SlowToRead(ReferenceDrafts):
    """Reference drafts from `first` tokens on, whose reading of the prompt takes `READING`
    seconds on the batch's clock."""

    READING = 1000.0

    def __init__(self, reference: list[int], start: int, first: int, clock: list[float]) -> None:
        super().__init__(reference, start, gap=5)
        self.next_at, self.clock = first, clock

    def prefill(self, tokens: Sequence[int]) -> None:
        self.clock[0] += self.READING


def test_a_drafts_reading_of_its_prompt_is_no_rounds_time(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that decode plainly a few rounds, then draft: the round in which a row's draft
    reads its prompt (once, paid by its trial) is timed without that reading, whether it is
    timed from the previous round's return or from its own start."""
    flat = Costs(verify=dict.fromkeys(range(1, 40), 1.0), plain_step=1.0)
    texts = prompts(loaded.tokenizer, 3)
    plains = [generate(loaded.target, p, GREEDY, None, limit=24)[0] for p in texts]
    shift = [0.0]  # seconds the batch's clock runs ahead of the real one
    monkeypatch.setattr(
        batch_module, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + shift[0])
    )
    gens = []
    for prompt, plain in zip(texts, plains, strict=True):
        source = _SlowToRead(plain, len(prompt), len(prompt) + 3, shift)
        gen = Generation(
            loaded.target, prompt, GREEDY, set(), 24, Rng(0), source, FixedDraftLength(flat, 3)
        )
        gen.prefill()
        gens.append(gen)
    timed: list[float] = []  # every round's seconds as the batch records and judges them
    monkeypatch.setattr(RoundTimes, "add_plain", lambda self, rows, s: timed.append(s))
    monkeypatch.setattr(RoundTimes, "hold_verify", lambda self, r, w, s, *a: timed.append(s))
    monkeypatch.setattr(RoundTimes, "add_verify", lambda self, r, w, s, d: timed.append(s))
    judge = RowBatch._judge

    def judged(self: RowBatch, drafts: list[Draft], committed: list[Committed], seconds: float,
               width: int, drafting: float) -> None:  # fmt: skip
        timed.append(seconds)
        judge(self, drafts, committed, seconds, width, drafting)

    monkeypatch.setattr(RowBatch, "_judge", judged)
    out, _ = _batched(loaded, flat, gens)
    assert out == plains
    assert shift[0] == 3 * _SlowToRead.READING  # each row's draft read its prompt once
    assert all(g.stats.rounds > 0 for g in gens)  # after plain rounds of the same rows
    assert timed and max(timed) < _SlowToRead.READING
    for g in gens:
        g.close()


def test_a_row_the_batch_keeps_declining_pauses_longer_each_time() -> None:
    """Each pause after `patience` declined rounds is twice the last, up to the longest; a
    round that verifies the row's drafts starts the backoff over."""
    ctl = DraftLengthController(SLOPED, 4, 0.0, patience=PATIENCE, pause_tokens=8)
    pauses = []
    for _ in range(4):
        for _ in range(PATIENCE):
            ctl.benched()
        assert ctl.off
        pauses.append(ctl.pause_tokens)
        ctl.resume()
    assert pauses == [8, 16, 32, 64]
    ctl.observe_time(1.0, 2, drafted=2)  # its drafts were verified
    for _ in range(PATIENCE):
        ctl.benched()
    assert ctl.pause_tokens == 8


def _model_drafting_rows(costs: Costs) -> list[Generation]:
    """Six rows of a small-vocabulary model, each drafting with a draft model, batched."""
    target = tiny_vocab_model(3, 8)
    return [
        Generation(target, [1, 2, 3], GREEDY, set(), 20, Rng(i),
                   ModelDraftSource(target, GREEDY, Rng(i)), DraftLengthController(costs, 4, 0.3))
        for i in range(6)
    ]  # fmt: skip


def test_a_batch_prices_its_rounds_as_it_measured_them() -> None:
    """The probe's single forwards say four drafts a row pay; this batch's own record says a
    verify round of that width costs ten of its plain rounds, and the planner declines. Until
    a width is on record the probe's curve prices it, scaled to the plain rounds measured."""
    costs = Costs(
        verify=dict.fromkeys(range(1, 40), 1.0), draft_step=0.3, draft_batch={1: 0.3, 8: 0.3}
    )
    gens = _model_drafting_rows(costs)
    times = RoundTimes(costs)
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    times.add_plain(6, 0.01)  # plain rounds measured at a hundredth of the probe's forward
    assert times.verify_round(6, 5, 1.2) == pytest.approx((1.0 + 1.2) * 0.01)
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    times.add_verify(6, 5, 0.1, 1.2)  # the first round of a shape (a compile) is not kept
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    times.add_verify(6, 5, 0.1, 1.2)  # one slow round on record: tried once more
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    times.add_verify(6, 5, 0.1, 1.2)
    assert plan_widths(gens, [4] * 6, costs, times) == [0] * 6
    times.add_verify(6, 5, 99.0, 1.2)  # a round that compiled a shape counts as ROUND_CAP
    assert times.verify[(6, 5)] == pytest.approx(0.1)  # the median of 0.1, 0.1 and the cap
    for _ in range(RETRY_ROUNDS):  # long after, the losing width is tried again
        times.add_plain(6, 0.01)
    assert not times.verify and plan_widths(gens, [4] * 6, costs, times) == [4] * 6


def test_where_nothing_compiles_a_shapes_first_verify_round_prices_it() -> None:
    """On exact caches (a CPU) the first verify round of a shape compiled nothing: it is kept,
    so two slow rounds decline a losing width where a GPU's batch, whose first round of a
    shape compiled it, runs three."""
    costs = Costs(
        verify=dict.fromkeys(range(1, 40), 1.0), draft_step=0.3, draft_batch={1: 0.3, 8: 0.3}
    )
    gens = _model_drafting_rows(costs)
    for compiles, rounds in ((True, 3), (False, 2)):
        times = RoundTimes(costs, compiles=compiles)
        times.add_plain(6, 0.01)
        for _ in range(rounds):
            assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
            times.add_verify(6, 5, 0.1, 1.2)
        assert plan_widths(gens, [4] * 6, costs, times) == [0] * 6, compiles


def test_one_slow_verify_round_does_not_stop_a_width_that_pays() -> None:
    """A verify round stalled by something else (the device, another thread) is one sample:
    the width stays priced by its other rounds; rounds that stay slow decline it."""
    costs = Costs(
        verify=dict.fromkeys(range(1, 40), 1.0), draft_step=0.3, draft_batch={1: 0.3, 8: 0.3}
    )
    gens = _model_drafting_rows(costs)
    times = RoundTimes(costs)
    times.add_plain(6, 0.01)
    times.add_verify(6, 5, 0.012, 1.2)  # the trial
    times.add_verify(6, 5, 5.0, 1.2)  # a stall
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    times.add_verify(6, 5, 0.012, 1.2)
    assert times.verify[(6, 5)] == pytest.approx(0.012)
    times.add_verify(6, 5, 0.013, 1.2)
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6
    for _ in range(3):  # it really got slow
        times.add_verify(6, 5, 1.0, 1.2)
    assert plan_widths(gens, [4] * 6, costs, times) == [0] * 6


def test_a_verify_round_is_priced_with_the_plain_round_it_unpipelines() -> None:
    """A verify round after which nothing was queued makes the next plain round run fresh:
    what that round took beyond a queued one is charged to the verify round's shape, so a
    width whose rounds pay only without that charge is declined. A verify round followed by
    a queued round, or by rounds of other rows, is recorded as it was."""
    costs = Costs(
        verify=dict.fromkeys(range(1, 40), 1.0), draft_step=0.3, draft_batch={1: 0.3, 8: 0.3}
    )
    gens = _model_drafting_rows(costs)
    times = RoundTimes(costs)
    times.add_plain(6, 0.01)
    times.hold_verify(6, 5, 0.015, 1.2)  # the trial, not recorded
    times.add_fresh(6, 0.012)
    for _ in range(2):
        times.hold_verify(6, 5, 0.015, 1.2)
        times.add_fresh(6, 0.03)  # 0.02 beyond a queued plain round
    assert times.verify[(6, 5)] == pytest.approx(0.035)
    assert plan_widths(gens, [4] * 6, costs, times) == [0] * 6  # 0.015 alone pays (below)

    times = RoundTimes(costs)
    times.add_plain(6, 0.01)
    times.hold_verify(6, 5, 0.015, 1.2)  # the trial
    times.flush()
    times.hold_verify(6, 5, 0.015, 1.2)
    times.flush()  # the next round was queued: as it was
    assert times.verify[(6, 5)] == pytest.approx(0.015)
    times.hold_verify(6, 5, 0.015, 1.2)
    times.add_fresh(5, 0.5)  # a row left: another batch's round
    assert times.verify[(6, 5)] == pytest.approx(0.015)
    assert plan_widths(gens, [4] * 6, costs, times) == [4] * 6


def test_a_verify_round_that_queued_the_next_round_unread_is_priced_with_it() -> None:
    """A verify round that queued the plain round after it before reading its verdicts spent
    part of its time building that round: what the round then took short of a pipelined one
    comes off the verify round's record (beyond one is added), never below the verify
    round's own time."""
    costs = Costs(
        verify=dict.fromkeys(range(1, 40), 1.0), draft_step=0.3, draft_batch={1: 0.3, 8: 0.3}
    )
    times = RoundTimes(costs)
    times.add_plain(6, 0.01)
    for taken in (0.002, 0.002, 0.002):  # the trial, then two on record
        times.hold_verify(6, 5, 0.02, 1.2, queueing=0.008)
        times.add_fresh(6, taken, queued=True)
    assert times.verify[(6, 5)] == pytest.approx(0.012)  # 0.02 + 0.002 - 0.01
    times = RoundTimes(costs)
    times.add_plain(6, 0.01)
    for _ in range(3):  # the queued round came almost free: the verify round's own time
        times.hold_verify(6, 5, 0.02, 1.2, queueing=0.004)
        times.add_fresh(6, 0.0, queued=True)
    assert times.verify[(6, 5)] == pytest.approx(0.016)
    for _ in range(3):  # it took longer than a pipelined round: the excess is added
        times.hold_verify(6, 5, 0.02, 1.2, queueing=0.004)
        times.add_fresh(6, 0.03, queued=True)
    assert times.verify[(6, 5)] == pytest.approx(0.04)


def test_shapes_not_yet_run_are_priced_as_the_verify_rounds_run_so_far_measured() -> None:
    """Verify rounds of one shape cost 3.5 times what the probe's forwards say: a shape
    not yet run (fewer rows) is priced so too, and declined without a losing trial."""
    costs = Costs(
        verify={w: 1.0 + 0.02 * w for w in range(1, 40)}, draft_step=0.05,
        draft_batch={1: 0.05, 8: 0.05},
    )  # fmt: skip
    gens = _model_drafting_rows(costs)
    times = RoundTimes(costs)
    for rows in (5, 6):
        times.add_plain(rows, costs.v(rows))
    assert times.excess() == 1.0
    assert plan_widths(gens[:5], [4] * 5, costs, times) == [4] * 5
    slow = 3.5 * (costs.v(30) + 0.2)
    for _ in range(3):  # a trial, then two rounds on record
        times.add_verify(6, 5, slow, 0.2)
    assert times.excess() == pytest.approx(3.5)
    assert plan_widths(gens, [4] * 6, costs, times) == [0] * 6
    assert plan_widths(gens[:5], [4] * 5, costs, times) == [0] * 5


def test_a_batch_drafts_on_expected_acceptance_where_a_lone_row_explores() -> None:
    """Rows that expect a third of their drafts accepted: alone, a row explores (its
    optimism bonus says a few drafts may pay); in a batch, where an exploratory round costs
    every row a wider forward, the plan drafts only on what the rows expect."""
    costs = Costs(verify={w: 1.0 if w <= 4 else 1.5 for w in range(1, 40)}, plain_step=1.0)
    gens = [
        Generation(tiny_vocab_model(3, 8), [1, 2, 3], GREEDY, set(), 20, Rng(i),
                   _AlwaysRejected([0] * 40, 0, 8),
                   DraftLengthController(costs, 4, 0.0, prior=0.3))
        for i in range(4)
    ]  # fmt: skip
    assert all(g.controller is not None and g.controller.choose() > 0 for g in gens)
    assert plan_widths(gens, [4] * 4, costs, RoundTimes(costs)) == [0] * 4


def test_a_batch_times_its_own_rounds(loaded: Loaded) -> None:
    """Verify rounds are timed by rows and width, pipelined plain rounds by rows; a round
    after other work on the runner (a prompt's chunk) is not timed. (The rows expect their
    drafts to be accepted, so the batch drafts for them until their record says otherwise.)"""
    gens, plains = _rejected_rows(loaded, SLOPED, 32, pause_tokens=64, prior=0.95)
    batch = RowBatch(loaded.target, SLOPED)
    batch.join(gens)
    out: list[list[int]] = [[] for _ in gens]
    for _ in range(12):
        for c in batch.round():
            out[gens.index(c.gen)] += c.tokens
    assert batch.times.verify and {rows for rows, _ in batch.times.verify} == {3}
    assert set(batch.times.plain) == {3} and batch.times.plain[3] > 0
    assert all(o == p[: len(o)] for o, p in zip(out, plains, strict=True))
    batch.untimed()
    assert batch._since() is None
    batch.drop_ahead()
    for g in gens:
        g.close()


def test_rounds_on_guessed_drafts_are_priced_by_their_own_record() -> None:
    """Four lookup rows whose verify rounds read first cost a hundred plain rounds: the plan
    declines them, but rounds queued on guesses are priced by the probe's curve until their
    own record (the first of a shape a trial) says they lose. A guess after longer drafts is
    worth less: it pays only if every one of them is accepted."""
    costs = Costs(verify=dict.fromkeys(range(1, 80), 1.0))
    target = tiny_vocab_model(3, 8)
    gens = [
        Generation(target, [1, 2, 3], GREEDY, set(), 40, Rng(i), LookupDraftSource(),
                   DraftLengthController(costs, 8, 0.0))
        for i in range(4)
    ]  # fmt: skip
    times = RoundTimes(costs)
    times.add_plain(4, 1.0)
    wants, priors = [8] * 4, [0] * 4
    times.verify = {(4, w): 100.0 for w in range(2, 10)}
    assert plan_widths(gens, wants, costs, times) == [0] * 4
    assert plan_widths(gens, wants, costs, times, priors=priors) == [8] * 4
    for _ in range(4):  # a trial, then rounds on record at 3 plain rounds
        times.add_queued(4, 9, 3.0)
    assert times.queued == {(4, 9): 3.0}
    assert plan_widths(gens, wants, costs, times, priors=priors) != [8] * 4
    one = gens[0]
    assert batch_module.guessed_tokens(one, 8, 0) > batch_module.guessed_tokens(one, 8, 4) > 1.0
    assert batch_module.guessed_tokens(one, 0, 0) == 1.0
