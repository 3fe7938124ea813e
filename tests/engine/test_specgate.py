"""A batch drafts only at row counts where drafting measured faster than not drafting."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from mlxd.engine import specgate
from mlxd.engine.backend import configure_backend
from mlxd.engine.batch import RoundTimes, RowBatch
from mlxd.engine.draftbatch import DraftBatch
from mlxd.engine.drafting import LookupDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import DEFAULT_DRAFT_TOKENS, Pairing, load_pairing
from mlxd.engine.sampling import Rng
from mlxd.engine.specgate import (
    ALL,
    EPOCH_ROUNDS,
    FREE,
    GAIN_SHARE,
    MAX_RETRY_EPOCHS,
    PLAIN,
    RETRY_EPOCHS,
    SpecGate,
)
from mlxd.registry.schema import ModelEntry
from tests.engine.conftest import GPU_TEST_BUCKET, PIECES
from tests.engine.test_rows import FLAT, PROMPTS, serve, solo_plain
from tests.fixtures.scripted_models import Script, build_scripted
from tests.fixtures.tiny_models import TinyPair


def run_levels(
    gate: SpecGate,
    rows: int,
    epochs: int,
    rate: dict[int, float],
    costly: bool = True,
    gained: int | None = None,
    free: int | None = None,
) -> list[int]:
    """Run `epochs` epochs of rounds, each level committing `rate[level]` tokens a second
    (`costly`: rows draft with a model), `gained` of a drafting round's `rows` tokens
    accepted from drafts (default: all past its first) and `free` of them from free drafts
    (default: all); the level each epoch ran."""
    levels = []
    for _ in range(epochs):
        level = gate.level(rows)
        levels.append(level)
        won = (rows - 1 if gained is None else gained) if level != PLAIN else 0
        won_free = won if free is None else min(free, won)
        for _ in range(EPOCH_ROUNDS):
            gate.record(rows, rows, rows / rate[level], costly, won, won_free)
    return levels


def run_epochs(gate: SpecGate, rows: int, epochs: int, rate: dict[bool, float]) -> list[bool]:
    """`run_levels` for rows without a draft model, drafting committing `rate[True]` tokens
    a second and plain decoding `rate[False]`: whether each epoch drafted."""
    rates = {ALL: rate[True], FREE: rate[True], PLAIN: rate[False]}
    return [level != PLAIN for level in run_levels(gate, rows, epochs, rates, costly=False)]


def test_drafting_runs_first_then_the_baseline_then_the_winner() -> None:
    gate = SpecGate()
    arms = run_epochs(gate, 4, 2 + RETRY_EPOCHS, {True: 1.4, False: 1.0})
    assert arms == [True, False] + [True] * RETRY_EPOCHS
    assert gate.rate(4, ALL) == pytest.approx(1.4) and gate.rate(4, PLAIN) == pytest.approx(1.0)
    # the loser is tried again, and loses again
    assert run_epochs(gate, 4, 2, {True: 1.4, False: 1.0}) == [False, True]
    assert gate.allows(4)
    assert gate.allows(8)  # another row count starts afresh


def test_a_row_count_not_yet_compared_starts_from_the_nearest_verdict() -> None:
    """Rows that come and go leave rounds at row counts that never run an epoch: those start
    with the winner of the nearest row count compared within a quarter of theirs (a row at
    least; the larger of two as near), its rates rescaled to their own at their first score,
    and try its loser after `RETRY_EPOCHS`; farther ones start afresh, drafting."""
    gate = SpecGate()
    assert gate.level(3) == ALL  # nothing compared anywhere: drafting first
    for _ in range(EPOCH_ROUNDS // 2):  # half an epoch of 3 rows, before 4 rows compare
        gate.record(3, 3, 3 / 0.6)
    assert run_epochs(gate, 4, 2, {True: 0.8, False: 1.0}) == [True, False]
    assert run_epochs(gate, 2, 2, {True: 0.9, False: 0.5}) == [True, False]
    assert gate.level(2) == ALL and gate.level(4) == PLAIN
    arms = run_epochs(gate, 3, RETRY_EPOCHS + 1, {True: 0.6, False: 0.75})
    assert arms == [False] * RETRY_EPOCHS + [True]
    assert gate.rate(3, PLAIN) == pytest.approx(0.75) and gate.rate(3, ALL) == pytest.approx(0.6)
    assert gate.level(5) == PLAIN and gate.level(1) == ALL  # beside 4 rows; beside 2
    assert gate.level(6) == ALL and gate.rate(6, PLAIN) is None  # 2 rows from 4: afresh


def test_drafting_that_loses_costs_a_few_per_cent_of_rounds() -> None:
    """Tried again after 8, 16, 32 and then every 64 epochs of the winner."""
    gate = SpecGate()
    arms = run_epochs(gate, 8, 1000, {True: 0.7, False: 1.0})
    trials = [i for i, arm in enumerate(arms) if arm][1:]
    gaps = [b - a - 1 for a, b in itertools.pairwise(trials)]
    assert gaps[:4] == [2 * RETRY_EPOCHS, 4 * RETRY_EPOCHS, MAX_RETRY_EPOCHS, MAX_RETRY_EPOCHS]
    assert sum(arms[100:]) / len(arms[100:]) < 0.02


def test_a_drafting_that_starts_paying_wins_back_its_rounds() -> None:
    gate = SpecGate()
    run_epochs(gate, 2, 40, {True: 0.8, False: 1.0})
    assert not gate.allows(2)
    arms = run_epochs(gate, 2, 2 * MAX_RETRY_EPOCHS, {True: 1.5, False: 1.0})
    assert arms[-RETRY_EPOCHS:] == [True] * RETRY_EPOCHS


def test_drafting_within_the_floor_of_plain_decoding_runs_on() -> None:
    gate = SpecGate()
    arms = run_epochs(gate, 4, 12, {True: 0.98, False: 1.0})
    assert arms[0] and not arms[1] and all(arms[2 : 2 + RETRY_EPOCHS])
    arms = run_epochs(SpecGate(), 4, 4, {True: 0.96, False: 1.0})
    assert arms == [True, False, False, False]


def test_where_drafting_with_a_model_loses_free_drafts_alone_are_tried() -> None:
    """Rows drafting with a model (`auto`): drafting loses to the baseline, so a third epoch
    drafts free drafts alone, which pay and run on; each loser is tried again on its own
    schedule. Rows without a model never run that epoch (it would draft the same)."""
    gate = SpecGate()
    rates = {ALL: 0.9, PLAIN: 1.0, FREE: 1.3}
    levels = run_levels(gate, 4, 3 + RETRY_EPOCHS + 3, rates)
    assert levels[:3] == [ALL, PLAIN, FREE]
    assert levels[3 : 3 + RETRY_EPOCHS] == [FREE] * RETRY_EPOCHS
    assert levels[3 + RETRY_EPOCHS :] == [PLAIN, FREE, ALL]  # both losers, one at a time
    assert gate.rate(4, FREE) == pytest.approx(1.3) and gate.level(4) == FREE
    # where the model's drafts pay again, drafting with it wins its next trial
    later = run_levels(gate, 4, 4 * RETRY_EPOCHS, {ALL: 1.6, PLAIN: 1.0, FREE: 1.3})
    assert later[-RETRY_EPOCHS:].count(ALL) >= RETRY_EPOCHS - 2  # its losers' trials aside
    # without a model there is nothing to leave out: drafting and the baseline only
    assert run_epochs(SpecGate(), 4, 4, {True: 0.9, False: 1.0}) == [True, False, False, False]
    # a free arm that loses too leaves plain decoding on; tried because drafting lost, it
    # must reach plain decoding's rate, where drafting need only come within the floor
    lost = run_levels(SpecGate(), 4, 5, {ALL: 0.8, PLAIN: 1.0, FREE: 0.98})
    assert lost == [ALL, PLAIN, FREE, PLAIN, PLAIN]


def test_free_drafts_win_only_where_they_gained() -> None:
    """Free drafts that gained under `GAIN_SHARE` of their epoch's tokens (a row's first
    token is no draft's) could gain no more than noise: however they scored, plain decoding
    runs on. They are tried wherever drafting with a model lost, however little its free
    drafts gained (a burst's first rounds, before the text repeats), and win at that share."""
    rates = {ALL: 0.9, PLAIN: 1.0, FREE: 1.3}
    rows = 50
    little = int(GAIN_SHARE * rows)  # a round's tokens are its 50 rows'
    assert little < GAIN_SHARE * rows
    assert run_levels(SpecGate(), rows, 4, rates, free=little) == [ALL, PLAIN, FREE, PLAIN]
    assert run_levels(SpecGate(), rows, 4, rates, free=little + 1) == [ALL, PLAIN, FREE, FREE]
    gate = SpecGate()  # the drafting epoch's free drafts gained nothing; the free epoch's did
    assert run_levels(gate, rows, 2, rates, free=0) == [ALL, PLAIN]
    assert run_levels(gate, rows, 2, rates, free=little + 1) == [FREE, FREE]


def test_drafting_within_the_floor_runs_on_only_where_its_drafts_gained() -> None:
    """Drafting at 0.98 of plain decoding runs on where its drafts gained `GAIN_SHARE` of its
    tokens (stretches of it pay); where they gained less, nothing of it paid, and plain
    decoding wins the tie. Its trial that gains again is judged within the floor again."""
    rates = {ALL: 0.98, PLAIN: 1.0, FREE: 0.9}
    rows = 50
    little = int(GAIN_SHARE * rows)
    gate = SpecGate()
    assert run_levels(gate, rows, 3, rates, False, gained=little) == [ALL, PLAIN, PLAIN]
    run_levels(gate, rows, RETRY_EPOCHS - 1, rates, False, gained=little)
    assert run_levels(gate, rows, 3, rates, False, gained=little + 1) == [ALL, ALL, ALL]
    assert run_levels(SpecGate(), rows, 3, rates, False, gained=little + 1) == [ALL, PLAIN, ALL]


def test_free_drafts_are_tried_once_rows_with_a_model_lose_a_trial() -> None:
    """A row count first scored without a draft model has two arms; a later trial of
    drafting, by rows with a model, that loses brings the free-drafts epoch in, and its loss
    too leaves plain decoding on."""
    gate = SpecGate()
    assert run_epochs(gate, 4, 2, {True: 0.9, False: 1.0}) == [True, False]
    levels = run_levels(gate, 4, RETRY_EPOCHS + 3, {ALL: 0.9, PLAIN: 1.0, FREE: 0.95})
    assert levels == [PLAIN] * RETRY_EPOCHS + [ALL, FREE, PLAIN]
    assert gate.rate(4, FREE) == pytest.approx(0.95)


def test_a_stalled_round_sinks_neither_arm(caplog: pytest.LogCaptureFixture) -> None:
    """A shape compiling mid-stream stalls one round for seconds: left out of its epoch's
    score (and logged), the drafting that pays runs on; a rate that is slower throughout
    still loses."""
    gate = SpecGate()
    with caplog.at_level("INFO", logger=specgate.__name__):
        for arm, rate in ((True, 1.4), (False, 1.0)):
            assert gate.allows(4) is arm
            for i in range(EPOCH_ROUNDS):
                gate.record(4, 4, 4 / rate * (200 if i == 3 else 1))
    assert gate.rate(4, ALL) == pytest.approx(1.4) and gate.allows(4)
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "4 rows, drafting scored 1.4 tok/s (1 stalled rounds left out); plain runs next",
        "4 rows, plain scored 1.0 tok/s (1 stalled rounds left out); drafting runs next",
    ]
    # stalls are judged within an epoch: drafting slower in every round, by more than
    # `STALL` times plain decoding's rounds, is scored whole and loses
    slower = SpecGate()
    run_epochs(slower, 4, 2, {True: 0.5 / specgate.STALL, False: 1.0})
    assert slower.rate(4, ALL) == pytest.approx(0.5 / specgate.STALL)
    assert not slower.allows(4)


def test_the_floor_off_leaves_drafting_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    gate = SpecGate()
    run_epochs(gate, 4, 10, {True: 0.5, False: 1.0})
    assert gate.allows(4)


def test_greedy_batches_and_batches_with_a_sampled_row_keep_their_own_records(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows accept far more drafts than sampled ones: where drafting lost to 4 greedy
    rows, 4 rows with a sampled one start with drafting, and the reverse."""
    monkeypatch.setattr(specgate, "floor_on", lambda: True)
    batch = RowBatch(copier.target, FLAT)

    def rows(*temperatures: float) -> list[Generation]:
        return [
            Generation(copier.target, [3, 4, 5], parse_options({"temperature": t}), set(), 8,
                       Rng(i))
            for i, t in enumerate(temperatures)
        ]  # fmt: skip

    greedy, sampled, mixed = rows(0, 0, 0, 0), rows(0.8, 0.8, 0.8, 0.8), rows(0, 0, 0, 0.8)
    losing = {ALL: 0.5, FREE: 0.5, PLAIN: 1.0}
    assert run_levels(batch.gate(greedy), 4, 3, losing, costly=False) == [ALL, PLAIN, PLAIN]
    assert batch.level(greedy) == PLAIN and batch._drafting(greedy) == [False] * 4
    assert batch.level(sampled) == ALL and batch._drafting(sampled) == [True] * 4
    assert batch.gate(mixed) is batch.gate(sampled)
    assert run_levels(batch.gate(mixed), 4, 3, {ALL: 1.5, PLAIN: 1.0}) == [ALL, PLAIN, ALL]
    assert batch.level(sampled) == ALL and batch.level(greedy) == PLAIN


@pytest.mark.parametrize("verify_cost", [10.0, 1.0], ids=["verify-loses", "verify-pays"])
def test_a_batch_stops_drafting_where_its_rounds_say_drafting_loses(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch, verify_cost: float
) -> None:
    """Four rows drafting with the target itself (every draft accepted, 5 tokens a row a
    round), scored on a clock where a plain round takes 1 and a verify round `verify_cost`:
    where verify rounds lose, the batch decodes plainly once the baseline is measured; where
    they pay, it drafts on. Either way each row commits its solo plain tokens."""
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, configure_backend(), costs=FLAT)
    verified: list[bool] = []  # per round the gate scored: whether it was a verify round
    read, record = RowBatch._read, SpecGate.record
    reading = [False]

    def noted_read(self: RowBatch, *args: Any, **kw: Any) -> Any:
        reading[0] = True
        return read(self, *args, **kw)

    def clocked(self: SpecGate, rows: int, tokens: int, seconds: float, *rest: Any) -> None:
        verified.append(reading[0])
        record(self, rows, tokens, verify_cost if reading[0] else 1.0, *rest)
        reading[0] = False

    monkeypatch.setattr(RowBatch, "_read", noted_read)
    # rows judge their drafts by this CPU's clock too, where drafting with the target itself
    # loses and they would pause: the floor is the gate's alone here
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    monkeypatch.setattr(specgate, "floor_on", lambda: True)
    # and the plan prices a verify round as a plain one (it would price them by this CPU's
    # clock): it always drafts, as a plan that prices verify rounds too low does
    monkeypatch.setattr(
        RoundTimes, "verify_round", lambda self, rows, *a, **k: self.plain_round(rows)
    )
    monkeypatch.setattr(SpecGate, "record", clocked)
    greedy = parse_options({"temperature": 0, "num_predict": 400, "draft_method": "model"})
    specs = [(PROMPTS[i], greedy) for i in range(4)]
    done = serve(pairing, specs)
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert len(verified) > 3 * EPOCH_ROUNDS
    assert any(verified[:EPOCH_ROUNDS])  # the first epoch drafts
    assert not any(verified[EPOCH_ROUNDS + 1 : 2 * EPOCH_ROUNDS])  # the baseline does not
    after = verified[2 * EPOCH_ROUNDS + 1 : 3 * EPOCH_ROUNDS]
    assert any(after) == (verify_cost == 1.0)


def flipping(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Epochs of two rounds and every loser retried at once, the gate alone deciding (rows'
    own floor off): drafting stops and starts every few rounds. Returns the gate's answers."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    monkeypatch.setattr(specgate, "floor_on", lambda: True)
    monkeypatch.setattr(specgate, "EPOCH_ROUNDS", 2)
    monkeypatch.setattr(specgate, "RETRY_EPOCHS", 1)
    monkeypatch.setattr(specgate, "MAX_RETRY_EPOCHS", 1)
    arms: list[bool] = []
    allows = SpecGate.allows

    def noted(self: SpecGate, rows: int) -> bool:
        arms.append(allows(self, rows))
        return arms[-1]

    monkeypatch.setattr(SpecGate, "allows", noted)
    return arms


def flipped(arms: list[bool]) -> int:
    return sum(a != b for a, b in itertools.pairwise(arms))


@pytest.mark.parametrize("layout", ["exact", "gpu"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_commit_their_solo_tokens_while_the_gate_flips_every_few_rounds(
    tiny_pair: TinyPair,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    layout: str,
    temperature: float,
) -> None:
    """Rows drafting with a model (mid-draft when drafting stops; they catch up on resuming),
    by lookup, both and neither, greedy or seeded, joining and leaving: each commits what it
    commits alone."""
    arms = flipping(monkeypatch)
    backend = request.getfixturevalue("gpu_layout") if layout == "gpu" else configure_backend()
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, backend, costs=FLAT)
    methods = ["model", "lookup", "auto", "model", "off", "lookup"]
    lengths = [40, 24, 36, 30, 12, 28]
    specs = [
        (p, parse_options({"temperature": temperature, "seed": i, "num_predict": n,
                           "draft_method": m}))
        for i, (p, m, n) in enumerate(zip(PROMPTS, methods, lengths, strict=True))
    ]  # fmt: skip
    done = serve(pairing, specs, start_after={3: (0, 4), 4: (1, 6), 5: (3, 3)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert flipped(arms) >= 4
    assert sum(d.speculation.accepted for d in done) > 0


@pytest.mark.parametrize("bucket", [None, GPU_TEST_BUCKET])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_copying_rows_commit_their_solo_tokens_while_the_gate_flips_every_few_rounds(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch, bucket: int | None, temperature: float
) -> None:
    """Rows copying their prompt by lookup, where most drafts are accepted: on the GPU's
    layout a batch of up to four queues rounds on guessed drafts, which a flip ends."""
    arms = flipping(monkeypatch)
    prompt = list(copier.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    specs = [
        (prompt, parse_options({"temperature": temperature, "seed": i, "num_predict": n,
                                "draft_method": "lookup"}))
        for i, n in enumerate([38, 30, 36, 24, 34])
    ]  # fmt: skip
    set_bucket(copier.target, bucket)
    try:
        done = serve(copier, specs, start_after={4: (0, 5)})
        solo = [solo_plain(copier, p, o, o.num_predict) for p, o in specs]
    finally:
        set_bucket(copier.target, None)
    assert [d.output_tokens for d in done] == solo
    assert flipped(arms) >= 2
    assert sum(d.speculation.accepted for d in done) > 20


def test_only_rounds_where_some_row_speculates_are_scored(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that never draft (draft_method off) would score either arm alike: their rounds
    leave the gate's record alone, as in a daemon serving requests of both kinds."""
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, configure_backend(), costs=FLAT)
    scored: list[int] = []
    record = SpecGate.record

    def noted(self: SpecGate, rows: int, *rest: Any) -> None:
        scored.append(rows)
        record(self, rows, *rest)

    monkeypatch.setattr(SpecGate, "record", noted)

    def opts(method: str) -> Any:
        return parse_options({"temperature": 0, "num_predict": 30, "draft_method": method})

    serve(pairing, [(PROMPTS[i], opts("off")) for i in range(3)])
    assert scored == []
    serve(pairing, [(PROMPTS[0], opts("model")), *[(PROMPTS[i], opts("off")) for i in (1, 2)]])
    assert scored and set(scored) <= {1, 2, 3}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_at_the_free_level_rows_draft_by_lookup_and_never_run_their_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """Rows of `auto` copying their prompt, in a batch the gate holds at `FREE`: lookup's
    drafts are verified, as long as a lookup row's (past the draft model's length), the draft
    model never drafts, and each row commits its solo tokens."""
    path = build_scripted(tmp_path, "generic", Script("@", PIECES))
    pairing = load_pairing(ModelEntry("p", str(path), draft=str(path)), configure_backend(), FLAT)
    monkeypatch.setattr(specgate, "floor_on", lambda: True)
    monkeypatch.setattr(SpecGate, "level", lambda self, rows: FREE if rows > 1 else ALL)
    drafted: list[int] = []
    propose = ModelDraftSource.propose

    def counted(self: ModelDraftSource, tokens: Any, n: int) -> Any:
        drafted.append(n)
        return propose(self, tokens, n)

    looked: list[int] = []
    look = LookupDraftSource.propose

    def long(self: LookupDraftSource, tokens: Any, n: int) -> Any:
        draft = look(self, tokens, n)
        looked.append(draft.count)
        return draft

    monkeypatch.setattr(ModelDraftSource, "propose", counted)
    monkeypatch.setattr(LookupDraftSource, "propose", long)
    monkeypatch.setattr(DraftBatch, "propose", lambda *a, **k: pytest.fail("model drafted"))
    gained: list[tuple[int, int]] = []  # (tokens, of them gained from free drafts) a round
    record = SpecGate.record

    def noted(self: SpecGate, rows: int, tokens: int, *rest: Any) -> None:
        gained.append((tokens, rest[-1]))
        record(self, rows, tokens, *rest)

    monkeypatch.setattr(SpecGate, "record", noted)
    prompt = list(pairing.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    specs = [
        (prompt, parse_options({"temperature": temperature, "seed": i, "num_predict": n,
                                "draft_method": "auto"}))
        for i, n in enumerate([30, 26, 34])
    ]  # fmt: skip
    done = serve(pairing, specs)
    assert [d.output_tokens for d in done] == [
        solo_plain(pairing, p, o, o.num_predict) for p, o in specs
    ]
    assert sum(d.speculation.accepted for d in done) > 10
    assert drafted == []
    assert max(looked) > DEFAULT_DRAFT_TOKENS
    # the gate learns what free drafts gained: each round's tokens past its rows' first
    assert any(free for _, free in gained) and all(free < tokens for tokens, free in gained)
