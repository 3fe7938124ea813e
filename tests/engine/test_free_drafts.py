"""Free drafts (prompt lookup, forced tokens) may run past a draft model's length: the cost model
picks how far, up to `FREE_DRAFT_TOKENS` unless the request or the entry caps it."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine import batch as batch_module
from mlxd.engine.backend import configure_backend
from mlxd.engine.batch import RowBatch, padded_width, plan_widths, round_widths
from mlxd.engine.drafting import (
    Draft,
    DraftSource,
    HybridDraftSource,
    LookupDraftSource,
    ModelDraftSource,
)
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import (
    DEFAULT_DRAFT_TOKENS,
    FREE_DRAFT_TOKENS,
    VERIFY_WIDTHS,
    WIDE_WIDTHS,
    Pairing,
    load_pairing,
    measure_costs,
    warm_up,
)
from mlxd.engine.sampling import Rng
from mlxd.engine.scheduler import make_draft_source
from mlxd.engine.speculation import Costs, DraftLengthController
from mlxd.engine.verify import Verdict
from mlxd.registry.schema import ModelEntry
from tests.engine.conftest import FLAT, GPU_TEST_BUCKET, PIECES
from tests.engine.test_speculative import tiny_vocab_model
from tests.fixtures.batches import decode_together, record_cuts
from tests.fixtures.issued import record_issued
from tests.fixtures.tiny_models import TinyPair


def steps_of(pairing: Pairing, prompt: list[int], **options: object) -> list[list[int]]:
    """The tokens each step of a lone row committed, the request's own draft source deciding."""
    opts = parse_options({"temperature": 0, **options})
    source, controller = make_draft_source(pairing, opts, Rng(0))
    limit = len(PIECES) + 1
    gen = Generation(
        pairing.target, prompt, opts, pairing.eos_ids, limit, Rng(0), source, controller
    )
    try:
        gen.prefill()
        return [new for new in gen if new]
    finally:
        gen.close()


def lookup_rows(pairing: Pairing, prompt: list[int], limits: Sequence[int]) -> list[Generation]:
    """Greedy rows of `prompt` drafting by prompt lookup, one per limit, prefilled."""
    greedy = parse_options({"temperature": 0})
    gens = [
        Generation(pairing.target, prompt, greedy, pairing.eos_ids, n, Rng(i),
                   LookupDraftSource(), DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0))
        for i, n in enumerate(limits)
    ]  # fmt: skip
    for g in gens:
        g.prefill()
    return gens


def test_lookup_verifies_a_long_copied_span_in_one_round(copier: Pairing) -> None:
    tokenizer = copier.tokenizer
    prompt = list(tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    written = prompt[1:-1]
    assert len(written) == len(PIECES)

    plain = steps_of(copier, prompt, draft_method="off")
    looked = steps_of(copier, prompt, draft_method="lookup")
    capped = steps_of(copier, prompt, draft_method="lookup", draft_num_predict=DEFAULT_DRAFT_TOKENS)

    def text(steps: list[list[int]]) -> list[int]:
        return [t for new in steps for t in new if t not in copier.eos_ids]

    assert text(plain) == text(looked) == text(capped) == written
    # one round commits FREE_DRAFT_TOKENS accepted drafts and the target's own next token
    # (queued behind a plainly decoded token in flight, that token as well)
    assert max(len(new) for new in looked) - FREE_DRAFT_TOKENS in (1, 2)
    assert max(len(new) for new in capped) - DEFAULT_DRAFT_TOKENS in (1, 2)
    assert len(looked) < len(capped) < len(plain)


def test_the_cap_follows_the_source_the_request_and_the_entry(tiny_pair: TinyPair) -> None:
    backend = configure_backend()
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, backend, costs=FLAT)

    def cap(p: Pairing, **options: object) -> int:
        source, controller = make_draft_source(p, parse_options(options), Rng(0))
        assert source is not None and controller is not None
        return controller.max_k

    assert cap(pairing, draft_method="lookup") == FREE_DRAFT_TOKENS
    assert cap(pairing, draft_method="model") == DEFAULT_DRAFT_TOKENS
    assert cap(pairing, draft_method="auto") == DEFAULT_DRAFT_TOKENS  # its model arm runs too
    assert cap(pairing, draft_method="lookup", draft_num_predict=2) == 2

    def after_model_arm(**options: object) -> int:
        """The cap once `auto` drops its draft model and continues with prompt lookup."""
        _, controller = make_draft_source(pairing, parse_options(options), Rng(0))
        assert controller is not None
        return controller.restart(draft_cost=0.0, source="lookup").max_k

    assert after_model_arm(draft_method="auto") == FREE_DRAFT_TOKENS
    assert after_model_arm(draft_method="auto", draft_num_predict=3) == 3

    alone = load_pairing(ModelEntry("q", str(tiny_pair.target)), backend, costs=FLAT)
    source, _ = make_draft_source(alone, parse_options({}), Rng(0))
    assert isinstance(source, LookupDraftSource)  # no draft model: `auto` is prompt lookup
    assert cap(alone) == FREE_DRAFT_TOKENS

    capped = ModelEntry("r", str(tiny_pair.target), draft_tokens=3)
    assert cap(load_pairing(capped, backend, costs=FLAT), draft_method="lookup") == 3


def test_warm_up_reaches_every_free_width(copier: Pairing, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt lookup's warm-up prompt holds a span it continues for as many drafts as asked."""
    seen: list[int] = []
    propose = LookupDraftSource.propose

    def recorded(self: LookupDraftSource, tokens: Sequence[int], n: int) -> Draft:
        draft = propose(self, tokens, n)
        seen.append(draft.count)
        return draft

    monkeypatch.setattr(LookupDraftSource, "propose", recorded)
    warm_up(copier.target, None, FLAT, max_k=FREE_DRAFT_TOKENS)
    assert max(seen) == FREE_DRAFT_TOKENS


def test_a_batch_cuts_long_free_drafts_to_a_width_that_pays() -> None:
    """Lone rows would verify 16 tokens (flat costs there); four of them in a batch would verify
    64, which costs eight plain rounds here: the batch verifies two tokens a row instead of
    none."""
    costs = Costs(verify={w: max(1.0, w / 8) for w in range(1, 80)})
    target = tiny_vocab_model(3, 8)
    greedy = parse_options({"temperature": 0})
    gens = [
        Generation(target, [1, 2, 3], greedy, set(), 40, Rng(i), LookupDraftSource(),
                   DraftLengthController(costs, FREE_DRAFT_TOKENS, 0.0))
        for i in range(4)
    ]  # fmt: skip
    assert plan_widths(gens, [FREE_DRAFT_TOKENS] * 4, costs) == [1] * 4


def test_a_batch_prices_an_auto_rows_lookup_hits_as_free() -> None:
    """A row of `auto` whose prompt lookup covers the round drafts for free: the batch prices
    it as a lookup row, where its draft model's steps (two plain steps a token here) would
    decline every draft. Without a lookup hit the model drafts, and is priced so."""
    costs = Costs(verify={w: 1.0 + w / 64 for w in range(1, 80)}, draft_step=2.0)
    target, draft = tiny_vocab_model(3, 8), tiny_vocab_model(4, 8)
    greedy = parse_options({"temperature": 0})

    def plan(prompt: list[int], auto: bool) -> list[int]:
        gens = []
        for i in range(2):
            lookup = LookupDraftSource()
            source: DraftSource = lookup
            if auto:
                source = HybridDraftSource(lookup, ModelDraftSource(draft, greedy, Rng(i)))
            lookup.prefill(prompt)
            controller = DraftLengthController(costs, 4, costs.draft_step if auto else 0.0)
            gens.append(Generation(target, prompt, greedy, set(), 40, Rng(i), source, controller))
        return plan_widths(gens, [4, 4], costs)

    repeats, fresh = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 0, 7, 6]
    assert plan(repeats, auto=False) == [4, 4]
    assert plan(repeats, auto=True) == [4, 4]  # lookup continues 4, 5, 6, 7
    assert plan(fresh, auto=True) == [0, 0]  # the draft model's turn: too dear


def test_a_batch_verifies_long_free_drafts_where_the_measured_curve_stays_flat() -> None:
    """On a GPU a forward of 64 or 128 tokens costs about what one of 16 does. Load measures
    those widths, so four rows of a batch verify eight lookup drafts each there; priced from
    the widest lone verify alone (every token past 16 as dear as the 16th), two."""
    target = tiny_vocab_model(3, 8)
    greedy = parse_options({"temperature": 0})

    def plan(costs: Costs) -> list[int]:
        gens = [
            Generation(target, [1, 2, 3], greedy, set(), 40, Rng(i), LookupDraftSource(),
                       DraftLengthController(costs, FREE_DRAFT_TOKENS, 0.0))
            for i in range(4)
        ]  # fmt: skip
        return plan_widths(gens, [FREE_DRAFT_TOKENS] * 4, costs)

    def curve(w: int) -> float:
        return 1.0 + w / 256  # flat: 128 tokens cost 1.5 of one

    lone = Costs(verify={w: curve(w) for w in VERIFY_WIDTHS})
    measured = Costs(verify={w: curve(w) for w in VERIFY_WIDTHS + WIDE_WIDTHS})
    assert plan(measured) == [8] * 4  # 4 x 9 tokens
    assert plan(lone) == [2] * 4  # 36 tokens priced as 2.25 times 16


def test_load_measures_the_widths_of_a_batchs_verify_rounds() -> None:
    """Where shapes compile (bucketed caches, a GPU's), what a batch's verify rounds cost
    (rows x width tokens, up to 8 x 16) is measured at probe-open, not extrapolated from a
    lone row's widest verify; elsewhere the curve stays about linear and is not."""
    model = tiny_vocab_model(3, 8)
    assert set(measure_costs(model, None).verify) == set(VERIFY_WIDTHS)
    set_bucket(model, 16)
    costs = measure_costs(model, None)
    assert set(VERIFY_WIDTHS + WIDE_WIDTHS) <= set(costs.verify)
    assert max(WIDE_WIDTHS) >= 8 * (FREE_DRAFT_TOKENS + 1)
    assert all(costs.verify[w] > 0 for w in WIDE_WIDTHS)


def test_a_batch_runs_only_the_widths_its_load_warmed(copier: Pairing) -> None:
    """Where shapes compile, a batch verifies only `round_widths` (what load runs for each row
    count): rows whose lookup drafts would make another width are padded up to one, and
    commit what they would have alone."""
    widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
    assert widths == (1, 2, 3, 4, 5, 9, 16)
    assert [padded_width(w, widths) for w in (1, 5, 6, 9, 10, 16)] == [1, 5, 9, 9, 16, 16]
    assert padded_width(7, None) == 7

    prompt = list(copier.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    limits = (12, 23, 37)  # rows leave at different rounds
    gens = lookup_rows(copier, prompt, limits)
    batch = RowBatch(copier.target, FLAT)
    batch.widths = widths
    seen: list[int] = []
    forward = batch.target

    def recorded(x: mx.array, cache: Any) -> mx.array:
        seen.append(int(x.shape[1]))
        return forward(x, cache=cache)

    batch.target = recorded  # type: ignore[assignment]
    out = decode_together(batch, gens)
    for g in gens:
        g.close()
    assert max(seen) > 5 and set(seen) <= set(widths), seen
    for i, n in enumerate(limits):
        assert out[i] == prompt[1 : 1 + n], i  # the copier's own text, as plain decoding


def test_rounds_far_slower_than_their_shape_are_logged_with_it(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A round over `SLOW_ROUND` and `SLOW_RATIO` times what its shape costs is a stall worth
    tracing: it is logged with its rows and width, and the part of it its read waited for the
    device (a device that stalls shows there; a kernel compiled while the round is encoded, or
    the host's own stall, in the rest). Here every
    round is, against costs of a microsecond a forward."""
    monkeypatch.setattr(batch_module, "SLOW_ROUND", 0.0)
    tiny = Costs(verify=dict.fromkeys(range(1, 80), 1e-6))
    greedy = parse_options({"temperature": 0})
    prompt = list(copier.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    gens = [
        Generation(copier.target, prompt, greedy, copier.eos_ids, 8, Rng(i), LookupDraftSource(),
                   DraftLengthController(tiny, FREE_DRAFT_TOKENS, 0.0))
        for i in range(2)
    ]  # fmt: skip
    for g in gens:
        g.prefill()
    with caplog.at_level(logging.WARNING, logger="mlxd.engine.batch"):
        decode_together(RowBatch(copier.target, tiny), gens)
    for g in gens:
        g.close()
    slow = [r.getMessage() for r in caplog.records if "slow round" in r.getMessage()]
    assert slow and all(m.startswith("slow round: 2 rows x ") for m in slow), slow
    for m in slow:  # with the part of it its read spent waiting for the device
        took, waited = re.search(r"took (\d+) ms .* waited (\d+) ms for the device", m).groups()
        assert int(waited) <= int(took)


def test_lookup_follows_tokens_not_yet_committed_without_learning_them() -> None:
    """`follow` continues a guessed commit from what lookup indexed, as `propose` would once
    it is committed, and leaves the index as it was; `auto` follows only where its `propose`
    would take lookup's drafts."""
    committed = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    lookup = LookupDraftSource()
    lookup.prefill(committed)
    index, indexed = dict(lookup.index), lookup._indexed
    guessed = [*committed, 3, 4]  # the round in flight accepting its drafts 3 and 4
    assert lookup.follow(guessed, 3) == [5, 6, 7]
    assert lookup.follow([*committed, 9, 9], 3) == []
    assert (lookup.index, lookup._indexed) == (index, indexed)
    assert lookup.propose(guessed, 3).tokens.tolist() == [5, 6, 7]
    assert lookup.follow(guessed, 0) == []

    class NoModel(ModelDraftSource):
        def __init__(self) -> None:  # never runs: `auto` follows lookup alone
            pass

    auto = HybridDraftSource(LookupDraftSource(), NoModel(), min_lookup=4)
    auto.lookup.prefill(committed)
    assert auto.follow(guessed, 4) == [5, 6, 7, 8]
    short = [1, 2, 3, 1, 2]
    auto.lookup.prefill(short)
    assert auto.lookup.follow([*short, 3], 4) == [1, 2, 3]
    assert auto.follow([*short, 3], 4) == []  # three of four: the draft model's turn


def test_lookup_counts_what_it_would_propose_without_building_it() -> None:
    """`found` (asked of every row each round of a batch) is `propose`'s count, learning the
    committed tokens as `propose` does, on a source that has read nothing yet too."""
    committed = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    for n in (0, 1, 3, 8, 20):
        counted, proposing = LookupDraftSource(), LookupDraftSource()
        assert counted.found(committed, n) == proposing.propose(committed, n).count
    lookup = LookupDraftSource()
    assert lookup.found([*committed, 3], 4) == 4
    assert lookup.found([*committed, 3, 9], 4) == 0


@pytest.mark.parametrize("fill", [True, False], ids=["fillers", "no-fillers"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("dear", [False, True], ids=["verify", "dear-verify"])
@pytest.mark.parametrize("bucket", [GPU_TEST_BUCKET, 16])
def test_verify_rounds_queued_on_guessed_drafts_commit_what_rows_commit_alone(
    copier: Pairing,
    monkeypatch: pytest.MonkeyPatch,
    bucket: int,
    dear: bool,
    temperature: float,
    fill: bool,
) -> None:
    """Rows drafting by prompt lookup queue each verify round on guessed drafts before
    the round ahead of it is read (bucketed caches, as on a GPU). Rows whose lookup is
    right, rows a decoy earlier in the prompt misleads (their guesses follow commits that do
    not happen), a row on `auto`, a row whose accepted drafts end with its end of sequence
    and a row that does not draft, leaving at different rounds and one joining mid-stream,
    each commit what they commit alone; guessed rounds ran, on guesses right and
    wrong, and the rows accepted drafts. Small buckets: the left padding every row shares,
    reckoned from the rows' tokens past a guessed round queued unread, is what the device
    holds. `dear`: the batch has timed verify rounds read before the next is queued at a
    hundred plain rounds, so it runs none: every draft is a guess queued after a plain
    round. Sampled rows (seeded) commit the tokens they commit alone too: each choice takes
    the noise of the position it lands on, and an off-track guess counts only its first.
    `fill` (`batch.FILLERS`): rows look the drafts of rounds queued before the one ahead is
    read up on the device, after what that round commits, and fill their free slots; the
    rows commit what they commit alone, here often on fillers."""
    monkeypatch.setattr(batch_module, "FILLERS", fill)
    tokenizer, opts = copier.tokenizer, parse_options({"temperature": temperature})

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    copy = "@" + "".join(PIECES) + "@"
    start = "@" + "".join(PIECES[:3])  # the copy's start: lookup continues its last match
    eos = min(copier.eos_ids)  # lookup drafts it too: the copy before ends with it
    prompts = [
        [*encode(copy[:-1]), eos, *encode("@" + "".join(PIECES[:30]))],
        encode(copy + "".join(PIECES[:6])),
        encode("@" + "".join(PIECES[:20]) + start + "@" + start),  # a decoy: "@" after it
        encode(copy + "".join(PIECES[:2])),
    ]
    plan = [(20, "lookup"), (27, "auto"), (30, "lookup"), (14, None)]  # (limit, drafts)
    set_bucket(copier.target, bucket)
    cuts = record_cuts(monkeypatch)  # (shared padding reckoned from tokens, read back)
    guessed_round = RowBatch._guessed_round
    on_track: list[bool] = []

    queued: list[int] = []  # rows' drafts in each round queued before the one ahead was read

    def noted(self: RowBatch, since: float | None) -> Any:
        ahead = self.ahead
        assert ahead is not None and ahead.expect is not None and ahead.drafts is not None
        for g, e in zip(self.gens, ahead.expect, strict=True):
            if e is not None:
                on_track.append(len(g.tokens) == e[0] and g.tokens[-len(e[1]) :] == e[1])
        queued.append(sum(d.count for d in ahead.drafts))
        return guessed_round(self, since)

    try:
        alone, gens = [], []
        for i, (prompt, (limit, drafts)) in enumerate(zip(prompts, plan, strict=True)):
            source: DraftSource | None = LookupDraftSource() if drafts else None
            if drafts == "auto":  # the copier drafting for itself where lookup finds nothing
                model = ModelDraftSource(copier.target, opts, Rng(i))
                source = HybridDraftSource(LookupDraftSource(), model)
            controller = DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0) if drafts else None
            solo = Generation(copier.target, prompt, opts, copier.eos_ids, limit, Rng(i))
            solo.prefill()
            alone.append([t for new in solo for t in new])
            solo.close()
            gens.append(
                Generation(copier.target, prompt, opts, copier.eos_ids, limit, Rng(i),
                           source, controller)
            )  # fmt: skip
        for g in gens:
            g.prefill()
        batch = RowBatch(copier.target, FLAT)
        batch.widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
        if dear:
            batch.times.verify = {(r, w): 100.0 for r in range(1, 5) for w in batch.widths}
        monkeypatch.setattr(RowBatch, "_guessed_round", noted)
        out: list[list[int]] = [[] for _ in gens]
        batch.join(gens[:3])
        rounds = 0
        while any(not g.done for g in gens):
            if rounds == 2:
                batch.join(gens[3:])
            for c in batch.round():
                out[gens.index(c.gen)] += c.tokens
            for g in [g for g in gens if g.done and g in batch]:
                batch.leave(g)
            rounds += 1
    finally:
        set_bucket(copier.target, None)
    assert out == alone
    if fill:  # looked up on the device after what the round ahead commits: no track to miss
        assert any(queued) and not on_track
    else:
        assert True in on_track and False in on_track
    assert all(mine == read for mine, read in cuts)
    assert cuts or bucket > 16
    for g in gens[:3]:
        assert g.stats.accepted + g.stats.filled_accepted > 0
        assert g.stats.accepted > 0 or fill
        assert g.stats.filled == 0 or fill


def test_only_batches_of_up_to_guess_rows_queue_rounds_on_guesses(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of more than `GUESS_ROWS` rows queues no verify round on guessed drafts; once
    rows leave and it holds no more, it does. The rows commit what they commit alone. (The
    floor off: rows a batch declines to verify would pause, and not draft when it shrinks.)"""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    prompt = list(copier.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    rows = batch_module.GUESS_ROWS + 2
    limits = [8 + 3 * i for i in range(rows)]  # the first rows leave early
    sizes: list[int] = []  # the batch's rows at each guessed round
    guessed_round = RowBatch._guessed_round

    def noted(self: RowBatch, since: float | None) -> Any:
        sizes.append(len(self.gens))
        return guessed_round(self, since)

    monkeypatch.setattr(RowBatch, "_guessed_round", noted)
    set_bucket(copier.target, GPU_TEST_BUCKET)
    try:
        gens = lookup_rows(copier, prompt, limits)
        batch = RowBatch(copier.target, FLAT)
        batch.times.verify = {(r, w): 100.0 for r in range(1, rows + 1) for w in range(1, 40)}
        out = decode_together(batch, gens)
    finally:
        set_bucket(copier.target, None)
    assert out == [list(prompt[1 : 1 + n]) for n in limits]
    assert sizes and max(sizes) <= batch_module.GUESS_ROWS


@pytest.mark.parametrize("fill", [True, False], ids=["fillers", "no-fillers"])
@pytest.mark.parametrize("seed", [100, 5])
@pytest.mark.parametrize("bucket", [GPU_TEST_BUCKET, 16])
def test_sampled_rows_on_guessed_drafts_commit_their_seeded_tokens(
    monkeypatch: pytest.MonkeyPatch, bucket: int, seed: int, fill: bool
) -> None:
    """Seeded rows at temperature 1 on a model whose choices the noise decides (a random
    one over 8 tokens) queue verify rounds on lookup's guesses, right and wrong, and commit
    what each commits alone: every choice takes the noise of the position it lands on, and a
    guess off its track counts only its first choice. Keys come as arrays of their own, as
    they do across a block's edge (`Rng.keys`), so a key picked past the positions asked for
    is never a neighbour's by chance. `fill`: drafts looked up on the device after what the
    round ahead commits, each choice's key picked there too."""
    monkeypatch.setattr(batch_module, "FILLERS", fill)
    keys = Rng.keys
    monkeypatch.setattr(Rng, "keys", lambda self, position, count: keys(self, position, count) + 0)
    target = tiny_vocab_model(7, 8)
    opts = parse_options({"temperature": 1.0})
    prompts = [
        [1, 2, 3, 4, 5, 6, 7] * 3,
        [2, 3, 4, 2, 3, 4, 2, 3],
        [5, 6, 5, 6, 5, 6, 5],
        [7, 1, 7, 1, 7],
    ]
    guessed_round = RowBatch._guessed_round
    tracks: list[bool] = []
    queued: list[int] = []

    def noted(self: RowBatch, since: float | None) -> Any:
        ahead = self.ahead
        assert ahead is not None and ahead.expect is not None and ahead.drafts is not None
        for g, e, d in zip(self.gens, ahead.expect, ahead.drafts, strict=True):
            if e is not None and d.count:
                tracks.append(len(g.tokens) == e[0] and g.tokens[-len(e[1]) :] == e[1])
            queued.append(d.count)
        return guessed_round(self, since)

    set_bucket(target, bucket)
    try:
        alone, gens = [], []
        for i, prompt in enumerate(prompts):
            solo = Generation(target, prompt, opts, set(), 200, Rng(seed + i))
            solo.prefill()
            alone.append([t for new in solo for t in new])
            solo.close()
            controller = DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0)
            gen = Generation(target, prompt, opts, set(), 200, Rng(seed + i),
                             LookupDraftSource(2, 1), controller)  # fmt: skip
            gen.prefill()
            gens.append(gen)
        batch = RowBatch(target, FLAT)
        batch.widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
        monkeypatch.setattr(RowBatch, "_guessed_round", noted)
        out: list[list[int]] = [[] for _ in gens]
        batch.join(gens)
        while any(not g.done for g in gens):
            for c in batch.round():
                out[gens.index(c.gen)] += c.tokens
            for g in [g for g in gens if g.done and g in batch]:
                batch.leave(g)
    finally:
        set_bucket(target, None)
    assert out == alone
    if fill:
        assert any(queued) and not tracks
        assert sum(g.stats.accepted + g.stats.filled_accepted for g in gens) > 0
    else:
        assert True in tracks and False in tracks
        assert sum(g.stats.accepted for g in gens) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("bucket", [None, GPU_TEST_BUCKET])
def test_rows_fill_a_rounds_free_slots_with_weaker_guesses(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch, bucket: int | None, temperature: float
) -> None:
    """A row copying its prompt sets every verify round's width; a row whose prompt holds its
    text in pairs of pieces after a letter, so that every other token it writes follows no
    earlier pair, fills its slots in those rounds with what followed its last token before
    (`LookupDraftSource.filler`) and commits some of them, and
    every row commits what it commits alone, greedy or seeded, fresh rounds and (bucketed
    caches) rounds queued on guesses. The fillers teach the row's controller nothing; a row
    without a source gets none."""
    tokenizer, opts = copier.tokenizer, parse_options({"temperature": temperature})

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    scattered = "".join(f"x{PIECES[i]}{PIECES[i + 1]}" for i in range(0, 30, 2))
    prompts = [encode("@" + "".join(PIECES) + "@"), encode(scattered + "@"), encode("@")]
    limits = [24, 30, 20]
    observed: list[tuple[int, int]] = []
    observe = DraftLengthController.observe

    def noted(self: DraftLengthController, proposed: int, accepted: int) -> None:
        if self is gens[1].controller:
            observed.append((proposed, accepted))
        observe(self, proposed, accepted)

    monkeypatch.setattr(DraftLengthController, "observe", noted)
    if bucket is not None:
        set_bucket(copier.target, bucket)
    try:
        alone, gens = [], []
        for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
            solo = Generation(copier.target, prompt, opts, copier.eos_ids, limit, Rng(i))
            solo.prefill()
            alone.append([t for new in solo for t in new])
            solo.close()
            drafts = i < 2
            gen = Generation(
                copier.target, prompt, opts, copier.eos_ids, limit, Rng(i),
                LookupDraftSource() if drafts else None,
                DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0) if drafts else None,
            )  # fmt: skip
            gen.prefill()
            gens.append(gen)
        batch = RowBatch(copier.target, FLAT)
        batch.widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
        out = decode_together(batch, gens)
    finally:
        set_bucket(copier.target, None)
    assert out == alone
    assert gens[1].stats.filled_accepted > 0
    assert gens[1].stats.filled > gens[1].stats.filled_accepted  # the letters after pieces
    assert all(a <= p for p, a in observed)  # a filler accepted is no draft accepted
    assert sum(p for p, _ in observed) == gens[1].stats.drafted
    assert gens[2].stats.filled == 0


def test_a_rows_fillers_are_verified_but_teach_its_controller_nothing(copier: Pairing) -> None:
    """`Generation.absorb` of a round with 1 draft and 3 fillers, 2 accepted: the draft's
    record counts 1 proposed and accepted, the fillers' their own counts."""
    prompt = list(copier.tokenizer.encode("@", add_special_tokens=False))
    controller = DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0)
    gen = Generation(copier.target, prompt, parse_options({"temperature": 0}), copier.eos_ids,
                     20, Rng(0), LookupDraftSource(), controller)  # fmt: skip
    gen.prefill()
    try:
        draft = Draft(mx.array([5, 6, 7, 8], dtype=mx.uint32), 4, "lookup", filler=3)
        assert draft.scored == 1
        new = gen.absorb(draft, Verdict(2, [5, 6, 9]))
        assert new == [5, 6, 9]
        assert (gen.stats.drafted, gen.stats.accepted) == (1, 1)
        assert (gen.stats.filled, gen.stats.filled_accepted) == (3, 1)
        assert controller.tries[:2] == [1.0, 0.0] and controller.hits[:1] == [1.0]
    finally:
        gen.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_learn_only_from_drafts_their_lookup_made(
    monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """A round queued before the one ahead is read takes each row's drafts from the device's
    lookup after what that round commits, the plan's share asked for beforehand: once read,
    a row's controller learns only from drafts a lookup match of two tokens or more made
    there (the host's own lookup after the same tokens, checked at every commit); the rest
    count as fillers."""
    monkeypatch.setattr(batch_module, "FILLERS", True)
    target = tiny_vocab_model(7, 8)
    opts = parse_options({"temperature": temperature})
    prompts = [[1, 2, 3, 4, 5, 6, 7] * 3, [2, 3, 4, 2, 3, 4, 2, 3], [5, 6, 5, 6, 5], [7, 1, 7]]
    seen: list[tuple[int, int]] = []  # (drafts learned from, drafts the lookup makes there)
    absorb = Generation.absorb

    def noted(self: Generation, draft: Draft, *args: Any, **kwargs: Any) -> list[int]:
        lookup = LookupDraftSource()
        lookup.prefill(self.tokens)
        seen.append((draft.scored, len(lookup.follow(self.tokens, draft.count))))
        return absorb(self, draft, *args, **kwargs)

    monkeypatch.setattr(Generation, "absorb", noted)
    set_bucket(target, 16)
    try:
        gens = []
        for i, prompt in enumerate(prompts):
            gen = Generation(target, prompt, opts, set(), 120, Rng(i), LookupDraftSource(),
                             DraftLengthController(FLAT, FREE_DRAFT_TOKENS, 0.0))  # fmt: skip
            gen.prefill()
            gens.append(gen)
        batch = RowBatch(target, FLAT)
        batch.widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
        decode_together(batch, gens)
    finally:
        set_bucket(target, None)
    assert all(learned <= made for learned, made in seen)
    assert any(learned for learned, _ in seen)
    assert sum(g.stats.filled_accepted for g in gens) > 0


@pytest.mark.parametrize("fill", [True, False], ids=["fillers", "no-fillers"])
def test_a_verify_round_read_after_the_next_is_queued_reads_only_what_was_issued_before_it(
    copier: Pairing, monkeypatch: pytest.MonkeyPatch, fill: bool
) -> None:
    """A verify round's choices and drafts, read once the round after it is queued, were
    issued to the device before that round: an array first evaluated inside the queued
    round's evaluation is ready only when all of it is, and reading it would wait for the
    round the queueing was meant to overlap. Both kinds of verify round: one planned and
    verified now (`round`), one queued on guessed drafts (`_guessed_round`)."""
    monkeypatch.setattr(batch_module, "FILLERS", fill)
    read = RowBatch._read
    checked: dict[bool, int] = {True: 0, False: 0}  # reads checked: guessed rounds', others'
    guessing = [False]

    def reading(self: RowBatch, drafts: list[Draft], chosen: list[mx.array], *rest: Any) -> Any:
        unread = rest[3]
        if unread:  # the next round was queued: the latest call
            for a in [*chosen, *(d.tokens for d in drafts if d.count)]:
                assert issued.before_latest(a)
            checked[guessing[0]] += 1
        return read(self, drafts, chosen, *rest)

    guessed_round = RowBatch._guessed_round

    def guessed(self: RowBatch, since: float | None) -> Any:
        guessing[0] = True
        try:
            return guessed_round(self, since)
        finally:
            guessing[0] = False

    issued = record_issued(monkeypatch)
    monkeypatch.setattr(RowBatch, "_read", reading)
    monkeypatch.setattr(RowBatch, "_guessed_round", guessed)
    prompt = list(copier.tokenizer.encode("@" + "".join(PIECES) + "@", add_special_tokens=False))
    set_bucket(copier.target, GPU_TEST_BUCKET)
    try:
        gens = lookup_rows(copier, prompt, [24, 30, 36])
        batch = RowBatch(copier.target, FLAT)
        batch.widths = round_widths(DEFAULT_DRAFT_TOKENS, FREE_DRAFT_TOKENS)
        out = decode_together(batch, gens)
    finally:
        set_bucket(copier.target, None)
    assert out == [list(prompt[1 : 1 + n]) for n in (24, 30, 36)]
    assert checked[True] and checked[False]
