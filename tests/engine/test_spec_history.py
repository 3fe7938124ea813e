"""A pairing's speculation history: later requests start from what earlier ones learned."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from mlxd.engine.drafting import (
    Draft,
    DraftSource,
    HybridDraftSource,
    LookupDraftSource,
    ModelDraftSource,
)
from mlxd.engine.generation import Generation
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import (
    TRIAL_SHARE,
    Costs,
    DraftLengthController,
    SourceRecord,
    SpecHistory,
)
from tests.engine.conftest import Loaded
from tests.engine.test_spec_floor import ReferenceDrafts
from tests.engine.test_speculative import generate, prompts

GREEDY = parse_options({"temperature": 0})
FLAT = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.05, plain_step=1.0)


def run(
    loaded: Loaded,
    prompt: list[int],
    controller: DraftLengthController,
    source: DraftSource | None = None,
) -> Generation:
    source = source or ModelDraftSource(loaded.draft, GREEDY, Rng(0))
    gen = Generation(loaded.target, prompt, GREEDY, {0, 2}, 48, Rng(0), source, controller)
    try:
        gen.prefill()
        gen.out = [t for new in gen for t in new]  # type: ignore[attr-defined]
    finally:
        gen.close()
    return gen


def test_a_source_that_did_not_pay_starts_paused_and_stays_lossless(loaded: Loaded) -> None:
    history = SpecHistory()
    history.record("model", SourceRecord([3.0], [4.0], spec_seconds=2.0, plain_seconds=1.0))
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    controller = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert controller.off
    gen = run(loaded, prompt, controller)
    assert gen.out == plain  # type: ignore[attr-defined]
    assert gen.stats.paused >= 1
    assert gen.stats.rounds == 0  # the whole 48-token request fit in the first pause


def test_requests_record_what_they_saw(loaded: Loaded) -> None:
    history = SpecHistory(max_tries=1000.0)
    prompt = prompts(loaded.tokenizer, 2)[1]
    first = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    run(loaded, prompt, first)
    past = history.get("model")
    assert past is not None and past.tries and past.tries[0] == first.tries[0] > 0
    assert past.hits[0] == first.hits[0]
    assert past.spec_seconds > 0 and past.plain_seconds > 0
    second = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    # the prior is what was seen, and exploration shrinks with it
    assert second.alphas(1) == first.alphas(1)
    fresh = DraftLengthController(FLAT, 4, 0.05)
    assert second.alphas(1, optimistic=True)[0] - second.alphas(1)[0] < (
        fresh.alphas(1, optimistic=True)[0] - fresh.alphas(1)[0]
    )
    assert history.get("lookup") is None


def test_history_decays_and_stays_a_prior() -> None:
    history = SpecHistory(decay=0.5, max_tries=10.0)
    for _ in range(20):
        history.record("model", SourceRecord([9.0, 1.0], [10.0, 9.0], 1.0, 2.0))
    past = history.get("model")
    assert past is not None
    assert past.tries[0] == 10.0  # capped
    assert abs(past.hits[0] / past.tries[0] - 0.9) < 1e-9  # the rate survives the cap
    assert abs(past.spec_seconds - 2.0) < 1e-3  # geometric sum of 1.0 with decay 0.5


def _not_paying(source: str = "model") -> SpecHistory:
    history = SpecHistory()
    history.record(source, SourceRecord([1.0], [4.0], spec_seconds=2.0, plain_seconds=1.0))
    return history


class _CountingDraft(ModelDraftSource):
    proposals = 0
    read: tuple[int, ...] = ()  # how many tokens each prefill was shown

    def prefill(self, tokens: Sequence[int]) -> None:
        self.read = (*self.read, len(tokens))
        super().prefill(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self.proposals += 1
        return super().propose(tokens, n)


def test_a_paused_request_leaves_the_draft_unread(loaded: Loaded) -> None:
    """A request that ends inside the pause never runs the draft model, not even over its
    prompt; the prefix cache catches the draft up afterwards to store its state."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    source = _CountingDraft(loaded.draft, GREEDY, Rng(0))
    controller = DraftLengthController(FLAT, 4, 0.05, history=_not_paying(), source="model")
    gen = Generation(loaded.target, prompt, GREEDY, {0, 2}, 48, Rng(0), source, controller)
    try:
        gen.prefill()
        assert [t for new in gen for t in new] == plain
        assert source.read == () and source.proposals == 0
        gen.ready_source()
        gen.ready_source()
        assert source.read == (len(gen.tokens),)
        assert source.cached == gen.tokens[:-1]
    finally:
        gen.close()


def test_auto_that_did_not_pay_starts_on_its_lookup_arm(loaded: Loaded) -> None:
    """What the cheaper arm decodes counts toward the full source's pause clock."""
    history = _not_paying("auto")
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    model = _CountingDraft(loaded.draft, GREEDY, Rng(0))
    source = HybridDraftSource(LookupDraftSource(), model)
    controller = DraftLengthController(FLAT, 4, 0.05, history=history, source="auto")
    gen = run(loaded, prompt, controller, source)
    assert gen.out == plain  # type: ignore[attr-defined]
    assert gen.stats.method == "auto"
    assert gen.stats.disabled_reason == "auto: continued with lookup only"
    assert model.proposals == 0
    later = DraftLengthController(FLAT, 4, 0.05, history=history, source="auto")
    assert later.off and later.pause_tokens == 256 - 48  # a draft model's pause: 256 tokens


def _short_pause(history: SpecHistory) -> DraftLengthController:
    """A draft model's controller with a 64-token pause (the tiny test requests are short)."""
    return DraftLengthController(FLAT, 4, 0.05, history=history, source="model", model_pause=64)


def test_requests_share_one_pause_clock(loaded: Loaded) -> None:
    """A request that ends inside the pause spends its plain tokens from the pairing's clock;
    the next one waits only for the rest. Its pause ends 16 tokens in, where the draft would
    first have to read the prompt and those 16 tokens with only 32 left to repay it: it stays
    plain to the end, and the request after it runs the trial from its start."""
    history = _not_paying()
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    first = run(loaded, prompt, _short_pause(history))
    assert first.stats.rounds == 0 and first.out == plain  # type: ignore[attr-defined]
    second = _short_pause(history)
    assert second.off and second.pause_tokens == 64 - 48
    source = _CountingDraft(loaded.draft, GREEDY, Rng(0))
    gen = run(loaded, prompt, second, source)
    assert gen.stats.rounds == 0 and source.read == ()  # no catch-up paid by plain tokens
    assert gen.out == plain  # type: ignore[attr-defined]
    third = _short_pause(history)
    assert not third.off  # the pause is spent
    source = _CountingDraft(loaded.draft, GREEDY, Rng(0))
    gen = run(loaded, prompt, third, source)
    assert gen.stats.rounds > 0 and source.read == (len(prompt),)  # the trial, from the start
    assert gen.out == plain  # type: ignore[attr-defined]


def test_failed_trials_lengthen_the_shared_pause() -> None:
    history = _not_paying()
    first = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert first.off and first.pause_tokens == 256
    first.paused_for(256)
    first.resume()
    for _ in range(first.patience):  # a trial whose rounds lose to plain decoding
        first.observe_time(3.0, 1)
    assert first.off and first.pause_tokens == 512
    first.conclude()
    later = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert later.off and later.pause_tokens == 512
    later.paused_for(512)
    trial = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert not trial.off  # the pause is spent: this request tries again


def test_a_trial_that_pays_stops_the_clock() -> None:
    history = _not_paying()
    history.pause_left("model", start=64)
    history.spend("model", 64)
    trial = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert not trial.off
    for _ in range(8):
        trial.observe(4, 4)
        trial.observe_time(0.5, 5)
    assert not trial.off
    trial.conclude()
    after = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert not after.off  # paying lately: no pause


def test_a_trial_cut_short_keeps_the_clock() -> None:
    """A request that ends before its trial is judged leaves the backoff where it was."""
    history = _not_paying()
    history.lengthen("model", 64, 1024)
    assert history.lengthen("model", 64, 1024) == 128
    history.spend("model", 128)
    trial = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    assert not trial.off
    for _ in range(trial.patience - 1):  # ends before the trial's verdict, on lucky rounds
        trial.observe(4, 4)
        trial.observe_time(0.5, 5)
    trial.conclude()
    failed = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    for _ in range(failed.patience):
        failed.observe_time(1.5, 1)
    assert failed.off and failed.pause_tokens == 256  # doubled from 128, not restarted


def test_a_trial_that_pays_restarts_the_backoff_within_a_request() -> None:
    """A trial judged paying clears the pairing's clock at once, so a later loss in the same
    request pauses for the shortest time again instead of twice the last pause."""
    history = SpecHistory()
    ctl = DraftLengthController(FLAT, 4, 0.05, history=history, source="model")
    for _ in range(ctl.patience):
        ctl.observe_time(1.5, 1)
    assert ctl.off and ctl.pause_tokens == 256
    ctl.resume()
    for _ in range(ctl.patience):
        ctl.observe_time(0.5, 5)
    assert not ctl.off
    assert history.pause_left("model", start=0) == 0  # cleared mid-request
    while not ctl.off:  # the recent rounds turn losing
        ctl.observe_time(3.0, 1)
    assert ctl.pause_tokens == 256


def test_without_a_history_lost_trials_still_back_off() -> None:
    ctl = DraftLengthController(FLAT, 4, 0.0, pause_tokens=64)
    pauses = []
    for _ in range(3):
        for _ in range(ctl.patience):
            ctl.observe_time(1.2, 1)  # a small loss: doubling is what sets the pause
        pauses.append(ctl.pause_tokens)
        ctl.resume()
    assert pauses == [64, 128, 256]


@pytest.mark.parametrize("shared", [False, True], ids=["own", "pairing's"])
def test_a_lost_trial_pauses_long_enough_to_repay_its_loss(shared: bool) -> None:
    """Trials of a losing source cost at most `TRIAL_SHARE` of the tokens decoded between them,
    however short the doubling pause would be: rounds 2 plain steps behind each pause ~50x
    their loss."""
    history = SpecHistory() if shared else None
    ctl = DraftLengthController(FLAT, 4, 0.0, pause_tokens=4, history=history, source="lookup")
    for _ in range(ctl.patience):
        ctl.observe_time(3.0, 1)
    lost = ctl.clock.excess(FLAT.plain)
    assert 6.0 < lost < 8.0  # decayed: four rounds, each 2 steps behind
    assert ctl.off and ctl.pause_tokens == math.ceil(lost / TRIAL_SHARE)
    if history is not None:
        assert history.pause_left("lookup", start=0) == ctl.pause_tokens
    ctl.resume()
    for _ in range(ctl.patience):
        ctl.observe_time(3.0, 1)
    assert ctl.pause_tokens == 2 * math.ceil(lost / TRIAL_SHARE)  # and doubling on from there


def test_greedy_and_sampled_requests_keep_separate_histories() -> None:
    """Sampled decoding accepts far fewer drafts than greedy: neither regime's record decides
    whether the other one speculates."""
    history = _not_paying("model/greedy")
    greedy = parse_options({"temperature": 0}).regime
    sampled = parse_options({"temperature": 0.7}).regime
    assert DraftLengthController(FLAT, 4, 0.05, history=history, source="model", regime=greedy).off
    fresh = DraftLengthController(FLAT, 4, 0.05, history=history, source="model", regime=sampled)
    assert not fresh.off
    fresh.observe(4, 4)
    fresh.conclude()
    assert history.get("model/sampled") is not None
    later = DraftLengthController(FLAT, 4, 0.05, history=history, source="model", regime=greedy)
    assert later.restart(0.0, "lookup").key == "lookup/greedy"


# a draft step at 0.59 of a target step and verify forwards at 1.5: the draft model pays only
# above about 0.9 acceptance (the fat 7B/0.5B pair's costs on an H200)
SLOW_DRAFT = Costs(
    verify={1: 1.0, **{w: 1.5 for w in range(2, 10)}}, draft_step=0.59, plain_step=1.0
)


def _history(hits: float, tries: float) -> SpecHistory:
    """A history in which the draft model paid lately (so no pause clock holds it back)."""
    history = SpecHistory()
    history.record("model", SourceRecord([hits], [tries], spec_seconds=1.0, plain_seconds=2.0))
    return history


def test_a_trial_is_hopeless_only_where_the_acceptance_is_known_and_cannot_pay() -> None:
    def controller(history: SpecHistory, cost: float = 0.59) -> DraftLengthController:
        return DraftLengthController(SLOW_DRAFT, 4, cost, history=history, source="model")

    low = controller(_history(18.0, 40.0))  # 0.45 over 40 rounds: no k reaches 0.8 of plain
    assert low.hopeless() and low.off  # the trial due at the request's start is skipped
    assert not controller(_history(38.0, 40.0)).hopeless()  # 0.95: it may pay
    assert not controller(_history(1.0, 4.0)).hopeless()  # too few rounds to know
    assert not controller(_history(18.0, 40.0), cost=0.0).hopeless()  # free drafts: try them


def test_a_paused_draft_model_whose_trials_would_lose_never_runs_them(loaded: Loaded) -> None:
    """Short pauses that keep ending: with an acceptance known to lose, each ends in another,
    longer pause and not in a trial (no round drafts); with it unknown, the trial runs. The
    tokens are plain decoding's either way."""
    prompt = prompts(loaded.tokenizer, 1)[0]
    plain, _ = generate(loaded.target, prompt, GREEDY, None, limit=48)
    rounds, paused = [], []
    for history in (_history(18.0, 40.0), _history(1.0, 2.0)):
        controller = DraftLengthController(
            SLOW_DRAFT, 4, 0.59, history=history, source="model", pause_tokens=2, model_pause=2
        )
        gen = run(loaded, prompt, controller, ReferenceDrafts(plain, len(prompt)))
        assert gen.out == plain  # type: ignore[attr-defined]
        rounds.append(gen.stats.rounds)
        paused.append(gen.stats.paused)
    assert rounds[0] == 0 and paused[0] == 1  # one pause, lengthened at each of its ends
    assert rounds[1] > 0


def test_a_mixed_source_whose_model_arm_lost_starts_the_next_request_on_its_free_arm() -> None:
    """`auto`'s record pays (its prompt-lookup rounds win), but its draft-model arm lost: the
    next request waits out the pause that loss started, on its free arm, instead of trying
    the losing arm again at once (every request used to)."""
    history = SpecHistory()
    first = DraftLengthController(FLAT, 4, 0.05, history=history, source="auto")
    for _ in range(8):  # lookup's rounds: 5 tokens for a plain step each
        first.observe(4, 4)
        first.observe_time(1.0, 5, drafted=4, arm="lookup")
    for _ in range(first.patience):  # the draft model's: a token for three steps
        first.observe_time(3.0, 1, drafted=4, arm="model")
    assert first.off
    first.conclude()
    record = history.get("auto")
    assert record is not None and record.spec_seconds < record.plain_seconds  # it pays overall
    later = DraftLengthController(FLAT, 4, 0.05, history=history, source="auto")
    assert later.off and later.pause_tokens == first.pause_tokens
    later.paused_for(later.pause_tokens)  # its free arm decoded the pause's tokens
    assert not DraftLengthController(FLAT, 4, 0.05, history=history, source="auto").off


def test_a_source_that_pays_overall_backs_off_by_doubling_only() -> None:
    """Its record pays (greedy prompt lookup: copies now and then): a lost trial pauses for
    the doubling's length, not for one that repays the loss, which would sit out the next
    copy."""
    history = SpecHistory()
    history.record("lookup", SourceRecord([8.0], [8.0], spec_seconds=10.0, plain_seconds=40.0))
    ctl = DraftLengthController(FLAT, 4, 0.0, pause_tokens=4, history=history, source="lookup")
    for _ in range(ctl.patience):
        ctl.observe_time(3.0, 1)
    assert ctl.off and ctl.pause_tokens == 4
