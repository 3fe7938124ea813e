"""Rows keep their state across solo and batched decoding: outputs, seeds, speculation."""

from __future__ import annotations

import queue
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlxd.engine import batch as batch_module
from mlxd.engine import scheduler as scheduler_module
from mlxd.engine.backend import Backend, configure_backend
from mlxd.engine.batch import Committed, RowBatch
from mlxd.engine.cache_use import namespace_for, restore
from mlxd.engine.drafting import Draft, DraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.events import Done, Event, Failed, GenerationRequest
from mlxd.engine.generation import Generation
from mlxd.engine.grammar import GrammarSpec
from mlxd.engine.kvcache import BucketedBatchKVCache, make_cache, set_bucket
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import Pairing, load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.sampling import Rng
from mlxd.engine.scheduler import Job, Scheduler, make_draft_source
from mlxd.engine.speculation import Costs, DraftLengthController
from mlxd.engine.verify import decide
from mlxd.registry.schema import ModelEntry
from tests.engine.conftest import GPU_TEST_BUCKET, Loaded
from tests.engine.test_speculative import (
    CHEAP,
    chi2_pvalue,
    exact_pair_distribution,
    tiny_vocab_model,
)
from tests.fixtures.batches import decode_together, record_cuts
from tests.fixtures.tiny_models import TinyPair

# Flat verify costs: speculation always looks worthwhile, in a batch too (up to width 9).
FLAT = Costs(verify={w: 1.0 for w in range(1, 40)}, draft_step=0.01)


def pairing_of(tiny_pair: TinyPair, draft: str = "draft") -> Pairing:
    path = tiny_pair.target if draft == "self" else tiny_pair.draft
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(path))
    return load_pairing(entry, configure_backend(), costs=FLAT)


def solo_plain(pairing: Pairing, prompt: list[int], opts: SamplingOptions, limit: int) -> list[int]:
    gen = Generation(pairing.target, prompt, opts, pairing.eos_ids, limit, Rng(opts.seed))
    try:
        gen.prefill()
        return [t for new in gen for t in new if t not in pairing.eos_ids]
    finally:
        gen.close()


Spec = tuple[list[int], SamplingOptions]


def serve(
    pairing: Pairing,
    specs: list[Spec],
    start_after: dict[int, tuple[int, int]] | None = None,
    num_parallel: int = 8,
    prefix: PrefixCache | None = None,
    grammars: list[GrammarSpec | None] | None = None,
    failed: dict[int, Failed] | None = None,
) -> list[Done]:
    """Run requests through one scheduler. `start_after[i] = (j, n)` queues request i once
    request j has streamed n events (a row joining mid-stream); others are queued at once.
    `grammars[i]` constrains request i. A request that fails lands in `failed` (pass one
    where a failure is expected; its place in the answer is then left out)."""
    start_after = start_after or {}
    jobs: queue.Queue[Job | None] = queue.Queue()
    done: dict[int, Done] = {}
    failures = failed if failed is not None else {}
    ended: set[int] = set()
    seen: Counter[int] = Counter()
    pending = dict(start_after)

    def job(i: int) -> Job:
        prompt, opts = specs[i]
        grammar = grammars[i] if grammars else None
        request = GenerationRequest(prompt, opts, grammar=grammar)
        return Job(request, emitter(i), lambda i=i: finished(i))

    def emitter(i: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            seen[i] += 1
            if isinstance(event, Done):
                done[i] = event
            elif isinstance(event, Failed):
                failures[i] = event
            for k, (j, n) in list(pending.items()):
                if j == i and seen[i] >= n:
                    del pending[k]
                    jobs.put(job(k))

        return emit

    def finished(i: int) -> None:
        ended.add(i)
        for k, (j, _) in list(pending.items()):
            if j == i:  # it ended before the event the request waited for: that one starts now
                del pending[k]
                jobs.put(job(k))
        if len(ended) == len(specs) and not pending:
            jobs.put(None)

    for i in range(len(specs)):
        if i not in start_after:
            jobs.put(job(i))
    Scheduler(pairing, jobs, prefix=prefix, num_parallel=num_parallel).run()
    assert failed is not None or not failures, failures
    return [done[i] for i in range(len(specs)) if i in done]


def opts_of(**kw: object) -> SamplingOptions:
    return parse_options(kw)


PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [20 + i % 7 for i in range(40)],
    [9, 10, 11],
    [30 + (i * 3) % 11 for i in range(25)],
    [44, 45, 46, 47, 48, 44, 45, 46],
    [60 + i % 5 for i in range(70)],
]


def test_greedy_rows_match_solo_plain_decoding_while_joining_and_leaving(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds: list[tuple[int, int, int]] = []  # (rows, width, distinct kept lengths)
    keep = RowBatch.keep

    def recorded(self: RowBatch, kept: list[int], width: int) -> None:
        rounds.append((len(kept), width, len(set(kept))))
        keep(self, kept, width)

    monkeypatch.setattr(RowBatch, "keep", recorded)
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")  # batched drafting itself is pinned here
    pairing = pairing_of(tiny_pair)
    methods = ["model", "lookup", "off", "model", "auto", "lookup"]
    lengths = [30, 12, 20, 40, 8, 25]
    specs = [
        (p, opts_of(temperature=0, num_predict=n, draft_method=m))
        for p, m, n in zip(PROMPTS, methods, lengths, strict=True)
    ]
    # three start together; the others join while they stream, and rows leave as they end
    done = serve(pairing, specs, start_after={3: (0, 4), 4: (1, 6), 5: (3, 3)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert sum(d.speculation.rounds for d in done) > 0
    # batched rounds verified drafts, and rows in one round kept different lengths
    assert any(rows >= 3 and width > 1 and distinct > 1 for rows, width, distinct in rounds)


def test_pipelined_plain_rounds_choose_what_plain_decoding_does(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain rounds queue the next round before reading this one; rows joining and leaving
    keep it (joiners ride the round after it). Greedy and seeded rows alike give their solo
    tokens."""
    seen = Counter[str]()
    plain_round, drop = RowBatch._plain_round, RowBatch.drop_ahead

    def counted_round(self: RowBatch, since: float | None = None) -> list[Committed]:
        seen["from ahead" if self.ahead is not None else "fresh"] += 1
        seen["joined behind"] += self.ahead is not None and len(self.ahead.gens) < len(self)
        return plain_round(self, since)

    def counted_drop(self: RowBatch) -> None:
        seen["dropped"] += self.ahead is not None
        drop(self)

    monkeypatch.setattr(RowBatch, "_plain_round", counted_round)
    monkeypatch.setattr(RowBatch, "drop_ahead", counted_drop)
    pairing = pairing_of(tiny_pair)
    temps = [0, 0.8, 0, 1.0, 0.6]
    lengths = [30, 14, 22, 36, 9]
    specs = [
        (p, opts_of(temperature=t, seed=7 + i, num_predict=n, draft_method="off"))
        for i, (p, t, n) in enumerate(zip(PROMPTS[:5], temps, lengths, strict=True))
    ]
    done = serve(pairing, specs, start_after={2: (0, 5), 3: (1, 4), 4: (3, 6)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert seen["from ahead"] > seen["fresh"] > 0
    assert seen["joined behind"] > 0  # rows joined with a round queued
    assert seen["dropped"] == 0  # and no queued round was taken back


@pytest.mark.parametrize("method", ["model", "off"])
def test_seeded_request_gives_the_same_tokens_alone_and_batched(
    tiny_pair: TinyPair, method: str
) -> None:
    pairing = pairing_of(tiny_pair, "self")
    mine = (PROMPTS[1], opts_of(temperature=0.9, seed=42, num_predict=24, draft_method=method))
    others = [
        (PROMPTS[i], opts_of(temperature=0.7, num_predict=10 + 5 * i, draft_method=m))
        for i, m in ((0, "model"), (3, "lookup"), (5, "off"))
    ]
    alone = serve(pairing, [mine])[0]
    together = serve(pairing, [mine, *others])[0]
    assert together.output_tokens == alone.output_tokens
    assert together.output_tokens == solo_plain(pairing, *mine, 24)
    if method == "model":
        assert together.speculation.accepted > 0


def test_four_client_burst_reports_accepted_drafts(tiny_pair: TinyPair) -> None:
    pairing = pairing_of(tiny_pair, "self")
    specs = [
        (PROMPTS[i], opts_of(temperature=t, num_predict=20, draft_method="model"))
        for i, t in ((0, 0), (1, 0.7), (2, 0), (3, 0.7))
    ]
    for final in serve(pairing, specs):
        assert final.speculation.rounds > 0
        assert final.speculation.accepted > 0


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_batched_speculative_rows_sample_the_targets_distribution(method: str) -> None:
    """Two rows of each batch sample the tested prompt; two fillers of other lengths keep the
    batch ragged (different widths, different accepted lengths)."""
    vocab = 5
    target = tiny_vocab_model(11, vocab)
    draft = tiny_vocab_model(12, vocab)
    prompt = [1, 3, 2, 1, 3]
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    expected = exact_pair_distribution(target, prompt, parse_options(base), vocab)
    counts: Counter[tuple[int, int]] = Counter()
    batches, drafted, together = 400, 0, 0
    for b in range(batches):
        gens = []
        for r, rows_prompt in enumerate((prompt, [2, 2, 4, 1, 0, 3, 1], prompt, [4, 4, 4])):
            seed = 4 * b + r
            opts = parse_options({**base, "seed": seed})
            rng = Rng(seed)
            source: DraftSource = (
                ModelDraftSource(draft, opts, rng) if method == "model" else LookupDraftSource(2, 1)
            )
            controller = DraftLengthController(CHEAP, 2 + r % 2, 0.01)
            gens.append(Generation(target, rows_prompt, opts, set(), 3, rng, source, controller))
        for g in gens:
            g.prefill()
        batch = RowBatch(target, FLAT)
        out = decode_together(batch, gens)
        for g in gens:
            drafted += g.stats.drafted
            g.close()
        together += batch.drafts.forwards if batch.drafts is not None else 0
        counts[(out[0][0], out[0][1])] += 1
        counts[(out[2][0], out[2][1])] += 1
    trials = 2 * batches
    assert drafted >= trials
    assert (together > 0) == (method == "model")  # the draft model drafted the rows together
    stat, df = 0.0, 0
    for cell, p in expected.items():
        e = p * trials
        if e >= 5:
            stat += (counts[cell] - e) ** 2 / e
            df += 1
    assert chi2_pvalue(stat, df - 1) > 1e-3, (stat, df)


def test_solo_and_batched_rows_hit_each_others_blocks(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One namespace per target: a block stored by a batched row (with the draft model's
    state attached) is hit by a later solo request without a draft, and a solo request's
    blocks are hit by a batched row that speculates with the draft model."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")  # drafting itself is pinned here, not its speed
    pairing = pairing_of(tiny_pair)
    prefix = PrefixCache(64 * 2**20)
    first = [5 + (j * 7) % 90 for j in range(150)]
    second = [7 + (j * 5) % 80 for j in range(140)]
    greedy = {"temperature": 0, "num_predict": 8}
    fillers = [(PROMPTS[i], opts_of(**greedy, draft_method="lookup")) for i in (1, 3)]

    batched = serve(pairing, [(first, opts_of(**greedy, draft_method="model")), *fillers],
                    prefix=prefix)  # fmt: skip
    assert batched[0].cached_tokens == 0
    solo = serve(pairing, [(first, opts_of(**greedy, draft_method="off"))], prefix=prefix)
    assert solo[0].cached_tokens == len(first) - 1
    assert solo[0].output_tokens == batched[0].output_tokens
    model = opts_of(**greedy, draft_method="model")
    source, _ = make_draft_source(pairing, model, Rng(0))
    assert isinstance(source, ModelDraftSource)
    restored, tokens = restore(prefix, namespace_for(pairing, model), pairing, first, source)
    assert restored is not None and tokens == len(first) - 1
    assert len(source.cached) >= 128 and source.cached == first[: len(source.cached)]

    alone = serve(pairing, [(second, opts_of(**greedy, draft_method="off"))], prefix=prefix)
    assert alone[0].cached_tokens == 0
    later = serve(pairing, [(second, model), *fillers], prefix=prefix)
    assert later[0].cached_tokens == len(second) - 1
    assert later[0].output_tokens == alone[0].output_tokens
    assert later[0].speculation.rounds > 0


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_seeded_rows_on_the_gpu_layout_give_their_solo_tokens(
    tiny_pair: TinyPair, gpu_layout: Backend, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Where a verify round queues the next plain round before its verdicts are read, a
    sampled row's next token takes the noise of the position it really lands on: a seeded
    request gives its solo plain tokens beside others, greedy and sampled."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, gpu_layout, costs=FLAT)
    unread: list[bool] = []  # per verify round: whether it queued the next round unread
    queue_unread = RowBatch._queue_unread

    def noted(self: RowBatch, *args: object) -> bool:
        unread.append(queue_unread(self, *args))  # type: ignore[arg-type]
        return unread[-1]

    monkeypatch.setattr(RowBatch, "_queue_unread", noted)
    mine = (PROMPTS[1], opts_of(temperature=0.9, seed=42, num_predict=24, draft_method=method))
    others = [
        (PROMPTS[i], opts_of(temperature=t, seed=i, num_predict=10 + 5 * i, draft_method=m))
        for i, t, m in ((0, 0.7, "model"), (3, 0.0, "lookup"), (5, 0.7, "off"))
    ]
    together = serve(pairing, [mine, *others])
    for (prompt, opts), final in zip([mine, *others], together, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert together[0].speculation.accepted > 0 and True in unread


def test_rounds_read_first_after_rounds_queued_unread_decode_exactly(
    tiny_pair: TinyPair, gpu_layout: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify rounds queued unread, then (a row with penalties joined: its choices need the
    host) verify rounds that read first and roll rows by counts read: the rows decode
    exactly across the change."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, gpu_layout, costs=FLAT)
    kinds: list[bool] = []  # per verify round: queued unread or not
    queue_unread = RowBatch._queue_unread

    def noted(self: RowBatch, *args: object) -> bool:
        kinds.append(queue_unread(self, *args))  # type: ignore[arg-type]
        return kinds[-1]

    monkeypatch.setattr(RowBatch, "_queue_unread", noted)
    specs = [
        (PROMPTS[0], opts_of(temperature=0, num_predict=40, draft_method="model")),
        (PROMPTS[3], opts_of(temperature=0, num_predict=40, draft_method="lookup")),
        (PROMPTS[2], opts_of(temperature=0, num_predict=12, repeat_penalty=1.3)),
    ]
    done = serve(pairing, specs, start_after={2: (0, 6)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    first_read = kinds.index(False, kinds.index(True))
    assert True in kinds[:first_read] and False in kinds[first_read:]


def test_accepted_drafts_counted_on_the_device_are_the_hosts_count() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 16)
        drafts = [rng.randint(0, 2) for _ in range(n)]
        chosen = [rng.randint(0, 2) for _ in range(n + 1)]
        on_device = batch_module._accepted(mx.array(drafts), mx.array(chosen)).item()
        assert on_device == decide(drafts, chosen).accepted


def test_verdicts_counted_for_all_rows_at_once_are_each_rows_own() -> None:
    """A round's choices as one grid (greedy rows): each row's kept count and next
    token are what its own count on the device and `decide` on the host give, whatever its
    slots past its drafts hold."""
    rng = random.Random(1)
    for _ in range(100):
        rows, width = rng.randint(1, 8), rng.randint(2, 17)
        counts = [rng.randint(0, width - 1) for _ in range(rows)]
        inputs = [[rng.randint(0, 2) for _ in range(width)] for _ in range(rows)]
        picks = [[rng.randint(0, 2) for _ in range(width)] for _ in range(rows)]
        drafts = [
            Draft(mx.array(r[1 : 1 + c], dtype=mx.uint32), c, "lookup")
            for r, c in zip(inputs, counts, strict=True)
        ]
        grid, given = mx.array(picks, dtype=mx.uint32), mx.array(inputs, dtype=mx.uint32)
        chosen = [grid[i, : 1 + c] for i, c in enumerate(counts)]
        together = batch_module._unread_verdicts(drafts, chosen, width, given, grid)
        alone = batch_module._unread_verdicts(drafts, chosen, width, given, None)
        assert together[0].tolist() == alone[0].tolist()
        assert together[1].tolist() == alone[1].tolist()
        for i, c in enumerate(counts):
            verdict = decide(inputs[i][1 : 1 + c], picks[i])
            assert together[0].tolist()[i] == verdict.accepted + 1
            assert together[1].tolist()[i] == verdict.tokens[-1]


def test_rows_cut_shared_padding_after_rounds_queued_unread(
    tiny_pair: TinyPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small buckets: verify rounds whose next round was queued before their verdicts were
    read leave whole buckets of left padding every row shares, and cut them by what the rows'
    tokens say (no device read), as a read of the device would; the rows decode on exactly."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    small = replace(configure_backend(), kv_bucket=16)
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, small, costs=FLAT)
    cuts = record_cuts(monkeypatch)  # (shared padding reckoned from tokens, read back)
    specs = [
        (p, opts_of(temperature=0, num_predict=60, draft_method=m))
        for p, m in zip(PROMPTS[:3], ("model", "lookup", "model"), strict=True)
    ]
    done = serve(pairing, specs)
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert cuts and all(mine == read for mine, read in cuts)
    assert any(mine >= 16 for mine, _ in cuts)


@pytest.mark.parametrize("bucket", [None, 64], ids=["exact", "bucketed"])
def test_a_row_leaving_keeps_the_queued_round_for_the_others(
    loaded: Loaded, monkeypatch: pytest.MonkeyPatch, bucket: int | None
) -> None:
    """A row that ends while a plain round is queued leaves without taking it back: the
    others decode on from it (no forward recomputed), the leaving row's own cache holds every
    committed token but the last, and on bucketed caches nothing is read from the device
    (each row's left padding is known from its tokens)."""
    model = loaded.target
    set_bucket(model, bucket)
    try:
        greedy = opts_of(temperature=0)
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
        gens = [Generation(model, p, greedy, set(), 40, Rng(i)) for i, p in enumerate(prompts)]
        for g in gens:
            g.prefill()
        batch = RowBatch(model, Costs(verify={1: 1.0}))
        batch.join(gens)
        for _ in range(3):
            batch.round()
        assert batch.ahead is not None
        if bucket:
            reads = []
            monkeypatch.setattr(BatchKVCache, "extract", lambda *a: reads.append("extract") or None)
            monkeypatch.setattr(BatchKVCache, "filter", lambda *a: reads.append("filter"))
        leaving = gens[1]
        batch.leave(leaving)
        if bucket:
            assert reads == []
            monkeypatch.undo()
        assert batch.ahead is not None and len(batch.ahead.gens) == 2  # still queued
        assert leaving.cache[0].offset == len(leaving.tokens) - 1
        while any(not g.done for g in batch.gens):
            batch.round()
        for g, prompt in zip([gens[0], gens[2]], [prompts[0], prompts[2]], strict=True):
            solo = Generation(model, prompt, greedy, set(), 40, Rng(0))
            solo.prefill()
            assert g.tokens[len(prompt) :] == [t for new in solo for t in new]
    finally:
        set_bucket(model, None)


@pytest.mark.parametrize("bucket", [None, 64], ids=["exact", "bucketed"])
def test_a_row_at_its_last_token_does_not_stop_the_others_pipelining(
    loaded: Loaded, bucket: int | None
) -> None:
    """Rows of different lengths: the round that ends a row is queued ahead for every row all
    the same (the ending row leaves with its queued position taken off its own cache), so
    every round but the first runs ahead, each row keeps its solo tokens, and a leaving row's
    cache holds every committed token but the last."""
    model = loaded.target
    set_bucket(model, bucket)
    try:
        greedy = opts_of(temperature=0)
        prompts, limits = [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [6, 11, 17]
        gens = [
            Generation(model, p, greedy, set(), n, Rng(i))
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))
        ]
        for g in gens:
            g.prefill()
        batch = RowBatch(model, Costs(verify={1: 1.0}))
        batch.join(gens)
        fresh = 0
        while len(batch):
            fresh += batch.ahead is None
            batch.round()
            for g in [g for g in batch.gens if g.done]:
                batch.leave(g)
                assert g.cache[0].offset == len(g.tokens) - 1
        assert fresh == 1
        for g, prompt, n in zip(gens, prompts, limits, strict=True):
            solo = Generation(model, prompt, greedy, set(), n, Rng(0))
            solo.prefill()
            assert g.tokens[len(prompt) :] == [t for new in solo for t in new]
    finally:
        set_bucket(model, None)


def test_bucketed_rows_joining_and_leaving_match_solo_decoding(
    tiny_pair: TinyPair, gpu_layout: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's layout, where a leaving row's padding comes from its tokens, not the device:
    rows speculating (verify rounds roll padding per row, by counts the host has not read
    where the next plain round is queued before the verdicts) and plain, joining and
    leaving."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    # the target drafting for itself: every draft accepted, so limits cut commits mid-round
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, gpu_layout, costs=FLAT)
    left: list[tuple[list[int], mx.array]] = []  # a leaving row's tokens and own keys
    leave = RowBatch.leave

    def checked(self: RowBatch, gen: Generation) -> None:
        leave(self, gen)  # checked after the run: an error here would end the rows, not the test
        left.append((list(gen.tokens), gen.cache[0].keys[..., : gen.cache[0].offset, :]))

    monkeypatch.setattr(RowBatch, "leave", checked)
    widths: Counter[tuple[int, int]] = Counter()  # (forward width, key buffer) over batches
    update = BucketedBatchKVCache.update_and_fetch

    def counted(self: BucketedBatchKVCache, k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        keys, values = update(self, k, v)
        widths[k.shape[2], keys.shape[2]] += 1
        return keys, values

    monkeypatch.setattr(BucketedBatchKVCache, "update_and_fetch", counted)
    settled: list[bool] = []  # per verify round queued unread: whether a row cut its commit
    settle = RowBatch._settle_unread

    def noted(self: RowBatch, kept: list[int], accepted: list[int], width: int) -> None:
        settled.append(kept != accepted)
        settle(self, kept, accepted, width)

    monkeypatch.setattr(RowBatch, "_settle_unread", noted)
    methods = ["model", "off", "model", "lookup", "model"]
    lengths = [26, 9, 31, 17, 13]
    specs = [
        (p, opts_of(temperature=0, num_predict=n, draft_method=m))
        for p, m, n in zip(PROMPTS[:5], methods, lengths, strict=True)
    ]
    # a token row 0 decodes mid-stream, and no row running beside it before, becomes an end
    # of sequence: row 0's commit stops there, inside a round whose drafts were all accepted
    first = solo_plain(pairing, PROMPTS[0], specs[0][1], 26)
    others = {t for i in (1, 2) for t in solo_plain(pairing, PROMPTS[i], specs[i][1], 20)}
    eos = next(t for t in first[5:] if t not in others and t not in first[:5])
    monkeypatch.setattr(Pairing, "eos_ids", property(lambda self: {eos}))
    done = serve(pairing, specs, start_after={2: (1, 2), 3: (0, 2), 4: (3, 2)})
    for (prompt, opts), final in zip(specs, done, strict=True):
        assert final.output_tokens == solo_plain(pairing, prompt, opts, opts.num_predict)
    assert done[0].done_reason == "stop" and done[0].speculation.accepted > 0
    # greedy verify rounds queued the next plain round before reading their verdicts, and
    # the round where row 0's end of sequence cut its commit took it back
    assert False in settled and True in settled
    # verify rounds and draft catch-ups over the batches (target and draft) attend over whole
    # buckets of keys, so their shapes recur on a GPU however rows join and leave
    assert any(width > 1 for width, _ in widths)
    assert {keys % GPU_TEST_BUCKET for _, keys in widths} == {0}, widths
    assert left
    for tokens, keys in left:  # the K/V a row takes along are its own tokens' (prefix cache)
        assert keys.shape[2] == len(tokens) - 1  # every committed token but the last
        cache = make_cache(pairing.target)
        pairing.target(mx.array([tokens[:-1]]), cache=cache)
        want = cache[0].keys[..., : len(tokens) - 1, :]
        assert mx.allclose(keys, want, atol=1e-4).item()


@pytest.mark.parametrize("bucket", [None, 64], ids=["exact", "bucketed"])
@pytest.mark.parametrize("taken_back", [False, True])
def test_a_row_joining_rides_the_round_after_the_queued_one(
    loaded: Loaded, bucket: int | None, taken_back: bool
) -> None:
    """A row joining while a plain round is queued for the others commits nothing in that
    round and its first token in the next, queued for every row; the queued round can still
    be taken back (off the older rows only). Every row gives its solo tokens."""
    model = loaded.target
    set_bucket(model, bucket)
    try:
        greedy = opts_of(temperature=0)
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]

        def row(i: int) -> Generation:
            g = Generation(model, prompts[i], greedy, set(), 30, Rng(i))
            g.prefill()
            return g

        gens = [row(0), row(1)]
        batch = RowBatch(model, Costs(verify={1: 1.0}))
        batch.join(gens)
        for _ in range(3):
            batch.round()
        joiner = row(2)
        joiner.settle()
        batch.join([joiner])
        assert batch.ahead is not None and len(batch.ahead.gens) == 2
        if taken_back:
            batch.drop_ahead()
        first = batch.round()  # the joiner commits nothing yet, unless the round was taken back
        assert [c.gen for c in first] == (batch.gens if taken_back else gens)
        while any(not g.done for g in batch.gens):
            batch.round()
        for g, prompt in zip([*gens, joiner], prompts, strict=True):
            solo = Generation(model, prompt, greedy, set(), 30, Rng(0))
            solo.prefill()
            assert g.tokens[len(prompt) :] == [t for new in solo for t in new]
    finally:
        set_bucket(model, None)


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
@pytest.mark.parametrize("method", ["lookup", "model"])
def test_a_lone_row_decoding_as_a_batch_of_one_gives_its_solo_tokens(
    tiny_pair: TinyPair,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    bucketed: bool,
) -> None:
    """`MLXD_LONE_ROW=batch`: a lone request decodes in batch rounds (pipelined where the
    caches are bucketed) and commits what plain decoding does, greedy and seeded."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    monkeypatch.setattr(scheduler_module, "LONE_BATCH", True)
    backend = request.getfixturevalue("gpu_layout") if bucketed else configure_backend()
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.target))
    pairing = load_pairing(entry, backend, costs=FLAT)
    rounds: list[int] = []  # rows of each batch round
    joins: list[int] = []
    unread: list[bool] = []
    batch_round, queue_unread, join = RowBatch.round, RowBatch._queue_unread, RowBatch.join

    def counted(self: RowBatch) -> list[Committed]:
        rounds.append(len(self))
        return batch_round(self)

    def joined(self: RowBatch, gens: Sequence[Generation]) -> None:
        joins.append(len(gens))
        join(self, gens)

    def noted(self: RowBatch, *args: object) -> bool:
        unread.append(queue_unread(self, *args))  # type: ignore[arg-type]
        return unread[-1]

    monkeypatch.setattr(RowBatch, "round", counted)
    monkeypatch.setattr(RowBatch, "_queue_unread", noted)
    monkeypatch.setattr(RowBatch, "join", joined)
    for temperature in (0.0, 0.9):
        opts = opts_of(temperature=temperature, seed=7, num_predict=24, draft_method=method)
        final = serve(pairing, [(PROMPTS[1], opts)])[0]
        assert final.output_tokens == solo_plain(pairing, PROMPTS[1], opts, 24)
        assert final.speculation.rounds > 0
        assert final.speculation.accepted > 0 or method == "lookup"  # the draft is the target
    assert rounds and set(rounds) == {1}
    assert joins == [1, 1]  # each request joins once and stays (its cache is the batch's)
    assert (True in unread) == (backend.kv_bucket is not None)  # a GPU's backend buckets
