"""The per-pairing loop: one request decodes speculatively; several decode as rows of one batch.

A lone request runs the speculative Generation (draft sources, lossless verification). When
others arrive it hands its caches to the batch between two rounds and carries on there: with
more than one row, batched plain decoding beats speculation (every row already shares each
weight read). Rows join and leave between steps; prefill is chunked and interleaved with the
running rows' decode steps; each row keeps its own options, seed, stop strings and limits.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import trim_prompt_cache

from mlxd.engine.cache_use import (
    has_companion,
    namespace_for,
    offer,
    offer_caches,
    offer_final,
    restore,
)
from mlxd.engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.events import Event, Failed, GenerationRequest
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import Pairing
from mlxd.engine.prefill import batchable, bucketed, feed, feed_rows, row_shape
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.rowstream import RowStream
from mlxd.engine.sampling import Rng, penalize, probabilities, sample, to_ints
from mlxd.engine.speculation import DraftLengthController

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # prompt tokens per step while other rows decode
MIN_FORWARD = 32  # what a short prompt's forward costs of that budget: a forward is never free


@dataclass
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]
    done: Callable[[], None]  # called once, when the job leaves the scheduler


# A row ready to join the batch: job, stream, the tokens in its cache plus the one to feed next
# (outside the cache), the cache, its prefix-cache namespace.
Joining = tuple[Job, RowStream, list[int], list[Any], Any]


@dataclass
class Prefilling:
    """A row reading its prompt, one chunk per scheduler step, before it joins the batch."""

    job: Job
    row: RowStream
    cache: list[Any]
    fed: list[int]  # prompt tokens whose K/V are in `cache`
    todo: list[int]  # prompt tokens still to feed (all but the last)
    ns: Any


def make_draft_source(
    pairing: Pairing, opts: SamplingOptions, rng: Rng
) -> tuple[DraftSource | None, DraftLengthController | None]:
    """The draft source and controller a request asks for (none when speculation is off)."""
    max_k = opts.draft_num_predict
    if max_k is None:
        max_k = pairing.default_draft_tokens
    method = opts.draft_method
    if max_k <= 0 or method == "off":
        return None, None
    source: DraftSource
    draft_cost = pairing.costs.draft_step
    if method == "lookup" or pairing.draft is None:
        source, draft_cost = LookupDraftSource(), 0.0
    elif method == "model":
        source = ModelDraftSource(pairing.draft, opts, rng)
    else:
        source = HybridDraftSource(LookupDraftSource(), ModelDraftSource(pairing.draft, opts, rng))
    controller = DraftLengthController(
        pairing.costs, max_k, draft_cost, history=pairing.history, source=source.name,
        regime=opts.regime,
    )  # fmt: skip
    return source, controller


def generation_limit(opts: SamplingOptions, prompt_len: int, context: int) -> int:
    """Tokens a request may generate: num_predict within its row's context (`row_context`)."""
    room = max(context - prompt_len, 1)
    return room if opts.num_predict < 0 else min(opts.num_predict, room)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def row_sampler(opts: SamplingOptions, rng: Rng) -> Callable[[mx.array], mx.array]:
    """The batch's per-row sampler; log-probabilities shape the same distribution as logits.
    Greedy rows share one function object, which the batch samples in a single call."""
    if opts.greedy:
        return _greedy
    return lambda logprobs: sample(probabilities(logprobs, opts), rng.next())


def row_processors(opts: SamplingOptions) -> list[Callable[[mx.array, mx.array], mx.array]]:
    if not opts.has_penalties:
        return []
    return [lambda tokens, logits: penalize(logits, to_ints(tokens), [], opts)]


class Scheduler:
    """Runs on the pairing's thread until the job queue yields None and all rows are done."""

    def __init__(
        self,
        pairing: Pairing,
        jobs: queue.Queue[Job | None],
        prefix: PrefixCache | None = None,
        num_parallel: int = 4,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        self.pairing = pairing
        self.flush = flush  # hands the step's events over to their consumers
        self.jobs = jobs
        self.prefix = prefix
        self.num_parallel = max(1, num_parallel)
        self.waiting: deque[Job] = deque()
        self.prefilling: deque[Prefilling] = deque()
        self.rows: dict[int, tuple[Job, RowStream, Any]] = {}  # uid -> (job, stream, namespace)
        self.batch: BatchGenerator | None = None
        self.stream = mx.new_stream(mx.default_device())
        self.stopping = False  # the stop marker arrived: finish the work in hand, then return

    def warm(self) -> None:
        """Run the batch's paths once at load: every shape of prompts read together, the
        decode step for every row count up to `num_parallel` (with the GPU's bucketed caches
        each row count is a new attention shape), then rows joining a running batch (merge,
        extend), a sampled row, and rows leaving it (filter, extract, remove). On CUDA each
        first use compiles; in the first burst of concurrent requests that is a stall of
        seconds, here it is part of the load."""
        if not bucketed(self.pairing.target):
            return
        target = self.pairing.target

        def filled(n: int) -> list[Any]:  # a row's cache after its prompt, as prefill leaves it
            cache = make_cache(target)
            feed(target, cache, [0] * n)
            return cache

        def batch_of(rows: int) -> BatchGenerator:
            return BatchGenerator(
                target, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows,
                stream=self.stream,
            )  # fmt: skip

        with mx.stream(self.stream):
            self._warm_row_groups()
            for rows in range(1, self.num_parallel + 1):
                batch = batch_of(rows)
                try:
                    batch.insert(
                        [[0]] * rows, max_tokens=[2] * rows, caches=[filled(3) for _ in range(rows)]
                    )
                    for _ in range(3):  # join (one forward for the new rows), then two steps
                        batch.next()
                finally:
                    batch.close()
            batch = batch_of(self.num_parallel)
            sampled = row_sampler(parse_options({"temperature": 0.7}), Rng(0))
            try:
                first = batch.insert([[0]], max_tokens=[8], caches=[filled(5)])[0]
                batch.next()
                batch.insert(
                    [[0], [0]], max_tokens=[2, 8], caches=[filled(7), filled(2)],
                    samplers=[_greedy, sampled],
                )  # fmt: skip
                for _ in range(4):  # the short row runs out (filter, extract)
                    batch.next()
                batch.remove([first], return_prompt_caches=True)
                batch.next()
            finally:
                batch.close()

    def _warm_row_groups(self) -> None:
        """Every (rows, width) shape `_row_group` can pick, for caches that can read together."""
        target = self.pairing.target
        if not batchable(make_cache(target)):
            return
        rows = 2
        while rows // 2 < self.num_parallel:
            width = 1
            while rows * width <= PREFILL_CHUNK:
                caches = [make_cache(target) for _ in range(rows)]
                feed_rows(target, caches, [[0] * width] * rows)
                mx.eval([c.state for cache in caches for c in cache])
                width *= 2
            rows *= 2

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            self.flush()
            busy = bool(self.rows or self.waiting or self.prefilling)
            stopping = self._collect(block=not busy and not self.stopping)
            if stopping and not (self.rows or self.waiting or self.prefilling):
                break
            alone = not (self.rows or self.prefilling) and len(self.waiting) == 1
            if alone and self.jobs.empty():
                self._guarded(self.waiting.popleft(), self._solo)
                continue
            self._admit()
            if self.prefilling:
                self._prefill_step()
            if self.rows:
                self._step()
        self.flush()
        if self.batch is not None:
            self.batch.close()
            self.batch = None

    def _collect(self, block: bool) -> bool:
        """Move queued jobs to `waiting`; True once the stop marker arrived (remembered, so
        a marker taken mid-request, by a solo request looking for company, is not lost)."""
        try:
            item = self.jobs.get() if block else self.jobs.get_nowait()
            while True:
                if item is None:
                    self.stopping = True
                    break
                self.waiting.append(item)
                item = self.jobs.get_nowait()
        except queue.Empty:
            pass
        return self.stopping

    def _guarded(self, job: Job, fn: Callable[[Job], bool]) -> None:
        """Run `fn`; a failure ends that request's stream with an error line, nothing else."""
        handed = False
        try:
            handed = fn(job)
        except Exception as exc:
            log.exception("generation failed")
            job.emit(Failed(str(exc) or type(exc).__name__))
        finally:
            if not handed:
                job.done()

    def _new_stream(self, job: Job) -> RowStream:
        req = job.request
        limit = generation_limit(
            req.options, len(req.prompt_tokens), self.pairing.row_context(req.options)
        )
        tok = self.pairing.tokenizer
        return RowStream(req, job.emit, tok.decode, self.pairing.eos_ids, limit)

    # -- one request: speculative decoding -----------------------------------------------------

    def _solo(self, job: Job) -> bool:
        """Decode one request speculatively; True when it was handed over to the batch."""
        req, pairing = job.request, self.pairing
        if req.cancel.is_set():
            return False
        req.started_now()
        opts = req.options
        rng = Rng(opts.seed)
        source, controller = make_draft_source(pairing, opts, rng)
        row = self._new_stream(job)
        ns = namespace_for(pairing, opts, source)
        companion = has_companion(source)
        restored = None
        if self.prefix is not None:
            restored, row.cached_tokens = restore(
                self.prefix, ns, pairing, req.prompt_tokens, source
            )
        gen = Generation(
            pairing.target, req.prompt_tokens, opts, pairing.eos_ids, row.limit, rng,
            source, controller, row.stats, cache=restored,
        )  # fmt: skip
        try:
            gen.prefill()
            row.prefilled()
            if self.prefix is not None:
                offer(self.prefix, ns, gen, companion)
            for new in gen:
                finished = row.push(new)
                self.flush()
                if finished:
                    break
                if not self.jobs.empty() or self.waiting:
                    self._collect(block=False)
                    if self.waiting:
                        return self._handover(job, row, gen)
            row.finish(gen.finish or "length")
            if self.prefix is not None and row.reason != "cancel":
                self.flush()  # the response goes out before the cache work (a draft may catch up)
                offer_final(self.prefix, ns, gen, pairing, len(req.prompt_tokens), companion)
            return False
        finally:
            if gen.cache:
                gen.close()

    def _handover(self, job: Job, row: RowStream, gen: Generation) -> bool:
        """Continue a solo request as a batch row from exactly its committed state."""
        pending = len(gen.tokens) - 1
        extra = gen.cached_tokens - pending
        if extra > 0 and trim_prompt_cache(gen.cache, extra) != extra:
            return False  # cannot rewind: stay solo
        if gen.source is not None:
            row.stats.disabled_reason = "batched with other requests"
        cache, gen.cache = gen.cache, []
        gen.close()
        ns = namespace_for(self.pairing, job.request.options, None)
        self._insert([(job, row, gen.tokens, cache, ns)])
        return True

    # -- many requests: rows of one batch ------------------------------------------------------

    def _ensure_batch(self) -> BatchGenerator:
        if self.batch is None:
            self.batch = BatchGenerator(
                self.pairing.target,
                stop_tokens=[[e] for e in sorted(self.pairing.eos_ids)],
                completion_batch_size=self.num_parallel,
                prefill_batch_size=self.num_parallel,
                prefill_step_size=PREFILL_CHUNK,
                stream=self.stream,
            )
        return self.batch

    def _insert(self, joining: list[Joining]) -> None:
        """Add rows to the batch; rows joining in one call share one forward."""
        samplers, processors, max_tokens = [], [], []
        for job, row, _, _, _ in joining:
            opts = job.request.options
            samplers.append(row_sampler(opts, Rng(opts.seed)))
            processors.append(row_processors(opts))
            max_tokens.append(max(row.limit - len(row.output), 1))
        uids = self._ensure_batch().insert(
            [[tokens[-1]] for _, _, tokens, _, _ in joining],
            max_tokens=max_tokens,
            caches=[cache for _, _, _, cache, _ in joining],
            all_tokens=[tokens[:-1] for _, _, tokens, _, _ in joining],
            samplers=samplers,
            logits_processors=processors,
        )
        for uid, (job, row, _, _, ns) in zip(uids, joining, strict=True):
            self.rows[uid] = (job, row, ns)

    def _admit(self) -> None:
        while self.waiting and len(self.rows) + len(self.prefilling) < self.num_parallel:
            job = self.waiting.popleft()
            try:
                if job.request.cancel.is_set():
                    job.done()
                    continue
                self._admit_one(job)
            except Exception as exc:
                log.exception("could not start a request")
                job.emit(Failed(str(exc) or type(exc).__name__))
                job.done()

    def _admit_one(self, job: Job) -> None:
        req = job.request
        req.started_now()
        row = self._new_stream(job)
        ns = namespace_for(self.pairing, req.options, None)
        restored = None
        if self.prefix is not None:
            restored, row.cached_tokens = restore(
                self.prefix, ns, self.pairing, req.prompt_tokens, None
            )
        hit = row.cached_tokens
        cache = restored if restored is not None else make_cache(self.pairing.target)
        prompt = req.prompt_tokens
        self.prefilling.append(Prefilling(job, row, cache, prompt[:hit], prompt[hit:-1], ns))

    def _prefill_step(self) -> None:
        """Feed waiting prompts, oldest first, up to PREFILL_CHUNK tokens (running rows decode
        between steps); prompts read to their last token join the batch together, in one
        forward."""
        with mx.stream(self.stream):
            joining = self._read_prompts()
            if self.prefix is not None:  # after every feed is queued: offering syncs
                for _, _, tokens, cache, ns in joining:
                    try:
                        offer_caches(self.prefix, ns, cache, tokens[:-1])
                    except Exception:  # the cache may miss a prompt; the request goes on
                        log.exception("prefix cache: offering a prompt failed")
        if not joining:
            return
        try:
            self._insert(joining)
        except Exception as exc:
            log.exception("could not add rows to the batch")
            for job, *_ in joining:
                job.emit(Failed(str(exc) or type(exc).__name__))
                job.done()

    def _read_prompts(self) -> list[Joining]:
        """One step's prompt reading; returns the rows read to their last token."""
        for p in [p for p in self.prefilling if p.job.request.cancel.is_set()]:
            self.prefilling.remove(p)
            p.row.finish("cancel")
            p.job.done()
        budget, joining = PREFILL_CHUNK, list[Joining]()
        group = self._row_group()
        if group:
            budget -= self._feed_group(group, joining)
        while self.prefilling and budget > 0:
            p = self.prefilling[0]
            try:
                if p.todo:
                    chunk, p.todo = p.todo[:budget], p.todo[budget:]
                    feed(self.pairing.target, p.cache, chunk)
                    mx.async_eval([c.state for c in p.cache])  # runs while the next is built
                    p.fed += chunk
                    budget -= max(len(chunk), MIN_FORWARD)
                if p.todo:
                    break
                self.prefilling.popleft()
                p.row.prefilled()
            except Exception as exc:
                self._drop_prefilling(p, exc)
                continue
            joining.append(self._joining(p))
        return joining

    @staticmethod
    def _joining(p: Prefilling) -> Joining:
        last = p.job.request.prompt_tokens[len(p.fed)]
        return (p.job, p.row, [*p.fed, last], p.cache, p.ns)

    def _row_group(self) -> list[Prefilling]:
        """The leading waiting prompts that one batched forward can read whole within a step's
        budget (at least two, each into an empty cache)."""
        group: list[Prefilling] = []
        for p in self.prefilling:
            if not p.todo or not batchable(p.cache):
                break
            rows, width = row_shape(
                len(group) + 1, max(len(q.todo) for q in [*group, p]), bucketed(self.pairing.target)
            )
            if rows * width > PREFILL_CHUNK:
                break
            group.append(p)
        return group if len(group) > 1 else []

    def _feed_group(self, group: list[Prefilling], joining: list[Joining]) -> int:
        """Read the group's prompts in one forward; they join this step. Returns the budget
        it used."""
        rows, width = row_shape(
            len(group), max(len(p.todo) for p in group), bucketed(self.pairing.target)
        )
        for _ in group:
            self.prefilling.popleft()
        try:
            feed_rows(self.pairing.target, [p.cache for p in group], [p.todo for p in group])
            mx.async_eval([c.state for p in group for c in p.cache])
        except Exception as exc:
            for p in group:
                self._drop_prefilling(p, exc)
            return rows * width
        for p in group:
            p.fed, p.todo = p.fed + p.todo, []
            p.row.prefilled()
            joining.append(self._joining(p))
        return rows * width

    def _drop_prefilling(self, p: Prefilling, exc: Exception) -> None:
        if self.prefilling and self.prefilling[0] is p:
            self.prefilling.popleft()
        log.exception("prefill failed", exc_info=exc)
        p.job.emit(Failed(str(exc) or type(exc).__name__))
        p.job.done()

    def _step(self) -> None:
        batch = self._ensure_batch()
        for uid, (job, _, _) in list(self.rows.items()):
            if job.request.cancel.is_set():
                self._retire(uid, "cancel")
        if not self.rows:
            return
        _, responses = batch.next()
        for r in responses:
            if r.uid not in self.rows:
                continue
            _, row, _ = self.rows[r.uid]
            finished = row.push([r.token])
            if r.finish_reason is not None:
                self._retire(r.uid, r.finish_reason, (r.prompt_cache, r.all_tokens))
            elif finished:
                self._retire(r.uid, row.reason)

    def _retire(self, uid: int, reason: str | None, state: tuple[Any, Any] | None = None) -> None:
        job, row, ns = self.rows.pop(uid)
        try:
            if state is None and self.batch is not None:
                state = self.batch.remove([uid], return_prompt_caches=True).get(uid)
            row.finish(reason)
            if self.prefix is not None and state is not None and row.reason != "cancel":
                cache, tokens = state
                offer_caches(self.prefix, ns, list(cache), list(tokens))
        except Exception:
            log.exception("finishing a row failed")
        finally:
            job.done()
