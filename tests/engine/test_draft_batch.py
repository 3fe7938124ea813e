"""A draft model drafts every batched row in one forward per draft step, proposing exactly
what each row's draft would propose alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd.engine.batch import RowBatch, plan_widths
from mlxd.engine.draftbatch import DraftBatch
from mlxd.engine.drafting import DraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.probestore import ProbeStore
from mlxd.engine.sampling import Rng, to_ints
from mlxd.engine.speculation import Costs, DraftLengthController
from tests.engine.conftest import Loaded
from tests.engine.test_rows import FLAT, PROMPTS, opts_of, pairing_of, serve, solo_plain
from tests.fixtures.tiny_models import TinyPair


@pytest.fixture(autouse=True)
def eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests count the draft model's forwards; a compiled step (`compiledstep`) replays
    its trace without calling the model, and is pinned by its own tests."""
    monkeypatch.setenv("MLXD_COMPILED_DRAFT", "0")


class Counted:
    """A model that records the (rows, width) of every forward it runs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(tuple(inputs.shape))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.mark.parametrize("bucket", [None, 16])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_drafts_equal_each_rows_solo_drafts(
    loaded: Loaded, temperature: float, bucket: int | None
) -> None:
    """Rows of different lengths, missing different numbers of committed tokens (one rides
    along several rounds without drafting, so it misses more than the shortest row holds),
    accepting different lengths: every round's batched draft equals the row's solo draft, one
    forward per draft step; a row leaving takes a draft state that drafts on alone. With
    bucketed caches (a GPU's, where every new forward shape compiles) every catch-up is a
    power of two wide."""
    set_bucket(loaded.draft, bucket)
    try:
        widths = _batched_drafts_equal_solo(loaded, temperature)
    finally:
        set_bucket(loaded.draft, None)
    if bucket:
        assert set(widths) <= {1, 2, 4, 8, 16, 32, 64}, widths
        assert len(set(widths)) > 1


def _batched_drafts_equal_solo(loaded: Loaded, temperature: float) -> list[int]:
    """The test above, on the draft as it is set up; returns each round's catch-up width."""
    prompts = [[9, 10, 11], [20 + i % 7 for i in range(30)], [5, 6, 7, 8, 5, 6, 7], [44, 45]]
    model = Counted(loaded.draft)
    widths: list[int] = []
    alone, together = [], []
    for i, p in enumerate(prompts):
        opts = parse_options({"temperature": temperature, "seed": 100 + i})
        alone.append(ModelDraftSource(loaded.draft, opts, Rng(opts.seed)))
        together.append(ModelDraftSource(model, opts, Rng(opts.seed)))
        alone[-1].prefill(p)
        together[-1].prefill(p)
    batch = DraftBatch(model)  # type: ignore[arg-type]
    batch.join(together)
    assert all(s.batch is batch and s.cache == [] for s in together)
    tokens = [list(p) for p in prompts]
    plans = [[3, 2, 0, 1], [1, 4, 0, 2], [2, 2, 0, 3], [4, 1, 3, 2], [1, 3, 2, 0]]
    for r, ks in enumerate(plans):
        before = len(model.calls)
        batched = batch.propose(tokens, ks)
        assert len(model.calls) - before == max(ks)  # one forward per draft step
        widths.append(model.calls[before][1])
        assert all(shape[0] == len(prompts) for shape in model.calls[before:])
        for i, k in enumerate(ks):
            solo = alone[i].propose(tokens[i], k)
            assert batched[i].count == solo.count == k
            if k:
                drafted = to_ints(batched[i].tokens)
                assert drafted == to_ints(solo.tokens), (r, i)
                accepted = (r + i) % (k + 1)
                bonus = (drafted[accepted] + 1) % 100 if accepted < k else 7
                tokens[i] += [*drafted[:accepted], bonus]
                alone[i].accept(tokens[i])
                together[i].accept(tokens[i])
            else:  # a round in which this row drafted otherwise (e.g. a lookup hit)
                tokens[i] += [30 + r, 31 + r, 32 + r]
    for i, s in enumerate(together):
        batch.leave(s)
        assert s.batch is None and int(s.cache[0].offset) == len(s.cached)
        last = alone[i].propose(tokens[i], 3)
        assert to_ints(s.propose(tokens[i], 3).tokens) == to_ints(last.tokens)
    assert len(batch) == 0
    return widths


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_gated_draft_batch_drafts_a_prefix_of_the_full_chain(
    loaded: Loaded, temperature: float
) -> None:
    """With measured costs, the rows' chain stops where one more step cannot pay: each row's
    draft is the start of what the batch drafts without the gate, one forward per step run,
    and rounds after a cut still draft what the ungated batch does (each row's draft K/V kept
    in step with what it fed)."""
    step_costs = {2: 0.3, 3: 0.4, 4: 0.5}  # a draft batch step by rows, in plain steps
    costs = Costs(verify={w: 1.0 for w in range(1, 33)}, draft_step=0.2, draft_batch=step_costs)
    prompts = [[9, 10, 11], [20 + i % 7 for i in range(30)], [5, 6, 7, 8, 5, 6, 7], [44, 45]]
    model = Counted(loaded.draft)
    batches = []
    for gated in (False, True):
        sources = []
        for i, p in enumerate(prompts):
            opts = parse_options({"temperature": temperature, "seed": 100 + i})
            sources.append(ModelDraftSource(model, opts, Rng(opts.seed), costs if gated else None))
            sources[-1].prefill(p)
        batch = DraftBatch(model)  # type: ignore[arg-type]
        batch.join(sources)
        batches.append((batch, sources))
    tokens = [list(p) for p in prompts]
    cut = 0
    for r in range(6):
        ks = [3, 4, 2, 4]
        full = batches[0][0].propose(tokens, ks)
        before = len(model.calls)
        short = batches[1][0].propose(tokens, ks)
        steps = max(d.count for d in short)
        assert len(model.calls) - before == steps  # the catch-up, then one per step run
        for i, k in enumerate(ks):
            assert 1 <= short[i].count <= k
            drafted = to_ints(short[i].tokens)
            assert drafted == to_ints(full[i].tokens)[: short[i].count], (r, i)
            cut += short[i].count < k
            accepted = (r + i) % (short[i].count + 1)
            bonus = (drafted[accepted] + 1) % 100 if accepted < short[i].count else 7
            tokens[i] += [*drafted[:accepted], bonus]
            for _, sources in batches:
                sources[i].accept(tokens[i])
    assert cut > 0


def rows_of(target: nn.Module, draft: Any, methods: list[str], temperature: float) -> list[Any]:
    gens = []
    for i, m in enumerate(methods):
        opts = parse_options({"temperature": temperature, "seed": i})
        rng = Rng(opts.seed)
        source: DraftSource | None = None
        if m == "model":
            source = ModelDraftSource(draft, opts, rng)
        elif m == "lookup":
            source = LookupDraftSource()
        controller = DraftLengthController(FLAT, 2 + i % 3, 0.01) if source else None
        prompt = PROMPTS[i % len(PROMPTS)]
        gens.append(Generation(target, prompt, opts, set(), 12 + 4 * i, rng, source, controller))
    return gens


def test_batched_rows_draft_in_one_forward_per_step(loaded: Loaded) -> None:
    """Four rows drafting with the draft model (here the target itself, so drafts are
    accepted), one with lookup, one without: each round runs the draft model once per draft
    step over all its rows, the rows commit their solo plain tokens and report drafts. A
    row's draft reads its prompt (alone) in the round its drafts are first taken, not when
    the prompt is read."""
    draft = Counted(loaded.target)
    methods = ["model", "lookup", "model", "off", "model", "model"]
    gens = rows_of(loaded.target, draft, methods, 0.0)
    for g in gens:
        g.prefill()
    assert draft.calls == []
    batch = RowBatch(loaded.target, FLAT)
    batch.join(gens)
    out: list[list[int]] = [[] for _ in gens]
    batched_rounds = 0
    unread = {i for i, m in enumerate(methods) if m == "model"}
    while len(batch):
        before = len(draft.calls)
        drafted = [g.stats.drafted for g in gens]
        lengths = [len(g.tokens) for g in gens]
        for c in batch.round():
            out[gens.index(c.gen)] += c.tokens
        steps = max(
            g.stats.drafted - d
            for g, d, m in zip(gens, drafted, methods, strict=True)
            if m == "model"
        )
        read = sorted(i for i in unread if gens[i].stats.drafted > drafted[i])
        unread -= set(read)
        calls = draft.calls[before:]
        assert calls[: len(read)] == [(1, lengths[i] - 1) for i in read]
        calls = calls[len(read) :]
        assert len(calls) == steps
        if steps:
            assert batch.drafts is not None
            assert all(rows == len(batch.drafts) for rows, _ in calls)
            batched_rounds += len(batch.drafts) > 1
        for g in [g for g in gens if g.done]:
            if g in batch:
                batch.leave(g)
    assert batched_rounds > 0
    for g, m, tokens in zip(gens, methods, out, strict=True):
        plain = Generation(loaded.target, g.tokens[: len(g.tokens) - len(tokens)], g.opts,
                           set(), g.limit, Rng(g.opts.seed))  # fmt: skip
        plain.prefill()
        assert tokens == [t for new in plain for t in new]
        if m == "model":
            assert g.stats.accepted > 0
        g.close()


def test_rows_joining_and_leaving_the_draft_batch_keep_their_outputs(
    tiny_pair: TinyPair,
) -> None:
    """Six requests (draft model, auto, lookup, off), joining mid-stream and leaving as they
    end: each equals its solo plain output, and the draft model drafted rows together."""
    pairing = pairing_of(tiny_pair, "self")
    counted = Counted(pairing.draft)
    pairing.draft = counted  # type: ignore[assignment]
    methods = ["model", "lookup", "auto", "model", "off", "model"]
    lengths = [30, 12, 20, 40, 8, 25]
    specs = [
        (p, opts_of(temperature=0, num_predict=n, draft_method=m))
        for p, m, n in zip(PROMPTS, methods, lengths, strict=True)
    ]
    done = serve(pairing, specs, start_after={3: (0, 4), 4: (1, 6), 5: (3, 3)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert max(rows for rows, width in counted.calls if width == 1) >= 3
    for final, m in zip(done, methods, strict=True):
        if m == "model":
            assert final.speculation.accepted > 0


def test_seeded_row_gives_the_same_tokens_alone_and_while_drafting_batched(
    tiny_pair: TinyPair,
) -> None:
    pairing = pairing_of(tiny_pair, "self")
    counted = Counted(pairing.draft)
    pairing.draft = counted  # type: ignore[assignment]
    mine = (PROMPTS[1], opts_of(temperature=0.9, seed=42, num_predict=24, draft_method="model"))
    others = [
        (PROMPTS[i], opts_of(temperature=0.7, seed=i, num_predict=16 + 4 * i, draft_method="model"))
        for i in (0, 3, 5)
    ]
    alone = serve(pairing, [mine])[0]
    assert all(rows == 1 for rows, _ in counted.calls)
    counted.calls.clear()
    together = serve(pairing, [mine, *others])
    assert together[0].output_tokens == alone.output_tokens
    assert max(rows for rows, _ in counted.calls) == 4  # the four rows drafted together
    assert all(final.speculation.accepted > 0 for final in together)


def test_batched_draft_steps_are_charged_once_per_batch() -> None:
    """A width's draft steps cost one B-row forward each, not B single-row ones: with measured
    batch steps as cheap as one row's, a batch drafts where per-row charges would not."""
    vocab = 8
    from tests.engine.test_speculative import tiny_vocab_model

    target = tiny_vocab_model(3, vocab)
    verify = {w: 1.0 for w in range(1, 40)}
    shared = Costs(verify=verify, draft_step=0.3, draft_batch={1: 0.3, 8: 0.3})
    per_row = Costs(verify=verify, draft_step=0.3)
    gens = []
    for i in range(6):
        opts = parse_options({"temperature": 0})
        source = ModelDraftSource(target, opts, Rng(i))
        gens.append(Generation(target, [1, 2, 3], opts, set(), 20, Rng(i), source,
                               DraftLengthController(shared, 4, 0.3)))  # fmt: skip
    assert all(g.drafts_batched for g in gens)
    assert plan_widths(gens, [4] * 6, shared) == [4] * 6
    assert plan_widths(gens, [4] * 6, per_row) == [0] * 6
    assert shared.draft_rows(4) == pytest.approx(0.3) and per_row.draft_rows(4) == pytest.approx(
        1.2
    )


def test_batched_draft_costs_interpolate_and_survive_a_restart(tmp_path: Path) -> None:
    costs = Costs(verify={1: 0.5, 2: 0.6}, draft_step=0.1, draft_batch={1: 0.1, 4: 0.4})
    assert costs.draft_rows(2) == pytest.approx(0.2)
    assert costs.draft_rows(8) == pytest.approx(0.8)  # linear past the largest measured
    assert costs.draft_rows(0) == 0.0
    store = ProbeStore(tmp_path)
    store.save("key", costs)
    assert store.load("key") == costs
