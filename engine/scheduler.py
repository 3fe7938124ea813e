"""The per-pairing loop: requests become rows, and rows are stepped alone or as one batch.

A row (`engine.row`) owns everything of its request for its whole life. With one row decoding
it is stepped alone (speculative rounds, pipelined plain decoding); with more, every row whose
cache can share a batch is stepped in one `RowBatch` round: one target forward verifies each
row's drafts (a row without drafts decodes one token in it). A row joining or leaving the batch
keeps its randomness, its speculation state and its prefix-cache namespace, so a seeded request
gives the same tokens whichever way it was stepped. Prompts are read in chunks between rounds;
prompts waiting together are read as rows of one forward and join together.
"""

from __future__ import annotations

import logging
import os
import queue
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxd.engine.adapters import AdaptedModel, selecting
from mlxd.engine.attention import warming
from mlxd.engine.batch import RowBatch, round_widths, warm_accepts, warm_rounds
from mlxd.engine.cache_use import (
    namespace_for,
    offer_caches,
    offer_final,
    offer_prompt,
    restore,
)
from mlxd.engine.draftbatch import warm_drafts
from mlxd.engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.events import Failed
from mlxd.engine.forced import ForcedDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.grammar import GrammarError, Matcher, row_grammar
from mlxd.engine.jitwarm import warm_model_kernels
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import FREE_DRAFT_TOKENS, Pairing, draft_cap, warm_up
from mlxd.engine.prefill import CHUNK, batchable, bucketed, feed, feed_rows, row_shape
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.row import Job, Row
from mlxd.engine.rowstream import RowStream
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import DraftLengthController
from mlxd.engine.threads import thread_stream

log = logging.getLogger(__name__)

PREFILL_CHUNK = 256  # prompt tokens per step while other rows decode
MIN_FORWARD = 32  # what a short prompt's forward costs of that budget: a forward is never free
# `MLXD_LONE_ROW=batch`: a lone row decodes as a batch of one once its prompt is read, so its
# verify rounds pipeline as a batch's do (the next round queued on drafts looked up on the
# device before this one is read, fillers in its free slots) where its own rounds wait for
# the host between rounds. Opt-in: on an H100 its plain rounds took 9.23 ms in-process against
# the lone step's 6.33 while a batch's per-row arrays sat in MLX's scalar pool (`kvcache`) and
# its reads waited for the round it had queued (`sampling.host_values`), and `auto` served 222
# tok/s against 339; with both gone, a batch of one's round took 8.21 ms against a lone step's
# 6.89 on another start (`bench/batch_parts.py`), not yet measured served
LONE_BATCH = os.environ.get("MLXD_LONE_ROW", "") == "batch"

__all__ = ["Job", "Joining", "Scheduler", "generation_limit", "make_draft_source"]

Joining = Row  # a row whose prompt is read, about to decode


@dataclass
class Prefilling:
    """A row reading its prompt, one chunk per scheduler step, before it decodes."""

    row: Row
    fed: list[int]  # prompt tokens whose K/V are in the row's cache
    todo: list[int]  # prompt tokens still to feed (all but the last)

    @property
    def cache(self) -> list[Any]:
        return self.row.gen.cache


def make_draft_source(
    pairing: Pairing,
    opts: SamplingOptions,
    rng: Rng,
    grammar: Matcher | None = None,
    draft_model: Any = None,
    adapter: str = "",
) -> tuple[DraftSource | None, DraftLengthController | None]:
    """The draft source and controller a request asks for (none when speculation is off).
    With a grammar, its forced tokens are drafted first, free, ahead of the source's own.
    `draft_model`: the draft as this request sees it (with its adapter), default the draft;
    `adapter`: the target adapter's revision, whose speculation history the row shares."""
    draft_model = pairing.draft if draft_model is None else draft_model
    method = opts.draft_method
    free = method in ("lookup", "forced") or pairing.draft is None  # no draft model runs
    max_k = draft_cap(opts.draft_num_predict, pairing.entry.draft_tokens, free)
    if max_k <= 0 or method == "off" or (method == "forced" and grammar is None):
        return None, None
    source: DraftSource
    draft_cost = pairing.costs.draft_step
    if method == "forced":
        assert grammar is not None
        source, draft_cost = ForcedDraftSource(grammar), 0.0
    elif method == "lookup" or pairing.draft is None:
        source, draft_cost = LookupDraftSource(), 0.0
    elif method == "model":
        source = ModelDraftSource(draft_model, opts, rng, pairing.costs)
    else:
        model = ModelDraftSource(draft_model, opts, rng, pairing.costs)
        source = HybridDraftSource(LookupDraftSource(), model)
    if grammar is not None and method != "forced":
        source = ForcedDraftSource(grammar, source)
    controller = DraftLengthController(
        pairing.costs, max_k, draft_cost, history=pairing.history_of(adapter), source=source.name,
        regime=opts.regime,
        free_k=draft_cap(opts.draft_num_predict, pairing.entry.draft_tokens, free=True),
    )  # fmt: skip
    return source, controller


def generation_limit(opts: SamplingOptions, prompt_len: int, context: int) -> int:
    """Tokens a request may generate: num_predict within its row's context (`row_context`)."""
    room = max(context - prompt_len, 1)
    return room if opts.num_predict < 0 else min(opts.num_predict, room)


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
        self.rows: list[Row] = []  # decoding, oldest first
        self.finished: list[Row] = []  # answered; their cache work waits (see `_offer_finished`)
        self.batch = RowBatch(pairing.target, pairing.costs)
        self.stream = thread_stream()  # built on the runner's thread, which it serves
        self.stopping = False  # the stop marker arrived: finish the work in hand, then return
        self._gathered = False  # this step already read prompts that arrived meanwhile

    def warm(self) -> None:
        """Run every shape once at load, on this (the serving) thread: MLX's CUDA build keeps
        what it compiled per thread, so a probe's warm-up on another thread leaves this one
        cold (a first request paid 1.5-3.9x a later one). The solo round shapes and every
        prompt chunk within the row context (`warm_up`), prompts read together, then for
        every row count up to `num_parallel` each round width a batch verifies (`round_widths`),
        and a round whose rows keep different lengths (the roll); first, every gather and
        scatter kernel serving uses (`jitwarm`: a module each, compiled once per machine).
        Multi-token attention at shapes not run here then takes MLX's plain operations
        (`attention.unwarmed`) rather than build a graph inside a round. Where nothing
        compiles (the CPU) there is nothing to warm."""
        pairing = self.pairing
        if not bucketed(pairing.target):
            return
        with mx.stream(self.stream), warming():
            warm_model_kernels(*(m for m in (pairing.target, pairing.draft) if m is not None))
            context = pairing.row_context(parse_options({}))
            warm_up(pairing.target, pairing.draft, pairing.costs, context=context)
            self._warm_row_groups()
            # a batch verifies only the widths warmed here: others are padded up to one
            widths = round_widths(pairing.default_draft_tokens, FREE_DRAFT_TOKENS)
            self.batch.widths = widths
            warm_accepts(widths)
            for rows in range(1 if LONE_BATCH else 2, self.num_parallel + 1):
                warm_rounds(self.pairing.target, rows, widths)
                if pairing.draft is not None:
                    warm_drafts(pairing.draft, rows, self.pairing.default_draft_tokens + 1)

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
        """Every MLX operation of the loop runs on the scheduler's stream: a restore, an offer
        and the rounds reading what they built never wait on one another across streams (on
        MLX's CUDA build a cross-stream dependency is a fence: a host or device wait)."""
        with mx.stream(self.stream):
            self._loop()
        self.flush()

    def _loop(self) -> None:
        while True:
            self.flush()  # after every step: the runner's heartbeat, then the step's events
            busy = bool(self.rows or self.waiting or self.prefilling or self.finished)
            stopping = self._collect(block=not busy and not self.stopping)
            self._offer_finished(hits_only=True)
            if stopping and not (self.rows or self.waiting or self.prefilling or self.finished):
                break
            self._admit()
            if self.prefilling:
                self.batch.untimed()  # a prompt's chunk is not the next round's time
                self._prefill_step()
            if self._gathering():
                continue
            self._offer_finished()
            if self.rows:
                self._step()
                self._gathered = False

    def _gathering(self) -> bool:
        """Whether to read the prompts that arrived while the last ones were read before any
        row decodes: requests sent together (clients released at once) then start in one
        round, not in two with a batch hand-over between (on an H200, 8 clients' prompts
        arrived over 6 ms and were read 5, then 3, a round apart). Once per step, and only
        while no row has decoded: rows already streaming never wait for a newcomer's prompt."""
        if self._gathered or not self.rows or any(r.gen.produced for r in self.rows):
            return False
        if self.jobs.empty() or len(self.rows) + len(self.prefilling) >= self.num_parallel:
            return False
        self._gathered = True
        return True

    def _collect(self, block: bool) -> bool:
        """Move queued jobs to `waiting`; True once the stop marker arrived (remembered, so
        a marker taken by any caller is never lost)."""
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

    # -- admission and prompts -----------------------------------------------------------------

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
                job.emit(_failed(exc))
                job.done()

    def _admit_one(self, job: Job) -> None:
        """A row for the request: its randomness, draft source, namespace, and what the prefix
        cache already holds of its prompt (the draft's state with it, when stored)."""
        req = job.request
        req.started_now()
        release: list[Callable[[], None]] = []  # the adapters it holds, until it closes
        try:
            row = self._new_row(job, release)
        except BaseException:
            for undo in release:
                undo()
            raise
        hit, prompt = row.stream.cached_tokens, req.prompt_tokens
        self.prefilling.append(Prefilling(row, list(prompt[:hit]), list(prompt[hit:-1])))

    def _new_row(self, job: Job, release: list[Callable[[], None]]) -> Row:
        """The request's row, on its adapters (each one's release added to `release`)."""
        req, pairing, opts = job.request, self.pairing, job.request.options
        target, draft = self._views(req.adapters, req.draft_adapters, release)
        rng = Rng(opts.seed)
        grammar = row_grammar(pairing, req.grammar)
        source, controller = make_draft_source(
            pairing, opts, rng, grammar, draft, _revision(target)
        )
        limit = generation_limit(opts, len(req.prompt_tokens), pairing.row_context(opts))
        stream = RowStream(req, job.emit, pairing.tokenizer.decode, pairing.eos_ids, limit)
        if opts.top_logprobs is not None:
            stream.token_bytes = pairing.token_bytes
        ns = namespace_for(pairing, opts, adapter=_revision(target))
        draft_revision = pairing.draft_revision
        if isinstance(draft, AdaptedModel):
            draft_revision += "+" + draft.mount.revision
        restored = None
        if self.prefix is not None:
            restored, stream.cached_tokens = restore(
                self.prefix, ns, pairing, req.prompt_tokens, source, draft_revision
            )
        gen = Generation(
            target, req.prompt_tokens, opts, pairing.eos_ids, limit, rng,
            source, controller, stream.stats, cache=restored, grammar=grammar,
        )  # fmt: skip
        return Row(job, stream, gen, ns, draft_revision=draft_revision, release=release)

    def _views(
        self, adapters: tuple[Any, ...], draft_adapters: tuple[Any, ...], release: list[Any]
    ) -> tuple[Any, Any]:
        """The target (and draft) as a request on adapters sees them, mounted now when they
        are not resident; each one's release goes into `release`."""
        pairing = self.pairing
        target: Any = pairing.target
        draft: Any = pairing.draft
        if adapters:
            target = pairing.adapters.acquire(adapters)
            release.append(lambda view=target: pairing.adapters.release(view))
        if draft_adapters and pairing.draft_adapters is not None:
            draft = pairing.draft_adapters.acquire(draft_adapters)
            release.append(lambda view=draft: pairing.draft_adapters.release(view))
        return target, draft

    def _prefill_step(self) -> None:
        """Feed waiting prompts, oldest first, up to PREFILL_CHUNK tokens while rows decode
        (a CHUNK with none); prompts read to their last token start decoding together."""
        joining = self._read_prompts()
        for row in list(joining):  # after every feed is queued: offering syncs
            try:
                row.gen.prefill()  # the draft reads the prompt; nothing left for the target
                row.unoffered = self.prefix is not None
            except Exception as exc:
                joining.remove(row)
                self._fail(row, exc)
        if joining:
            self._insert(joining)

    def _offer_prompt(self, row: Row) -> None:
        """Offer a row's prompt to the prefix cache, once. A lone row offers it after its
        first token went out (offering syncs and copies: on an H200, 60 ms at 2k tokens and
        156 ms at 7k that the first token would otherwise wait); a row joining the batch
        offers it before it joins, while its K/V are still its own. A row cancelled first
        offers it when it ends: an editor that cancels sends the same prefix again."""
        if not row.unoffered or self.prefix is None:
            return
        row.unoffered = False
        if row.batched:
            return  # its K/V sit in the batch cache: it offers everything at its end
        prompt_len = len(row.request.prompt_tokens)
        rate = self.pairing.costs.recompute_rate
        offer_prompt(self.prefix, row.ns, row.gen, prompt_len, row.draft_revision, rate)
        row.offered = prompt_len - 1

    def _insert(self, joining: list[Joining]) -> None:
        """Rows start decoding; those joining in one step enter the batch together."""
        self.rows.extend(joining)

    def _read_prompts(self) -> list[Joining]:
        """One step's prompt reading; returns the rows read to their last token."""
        for p in [p for p in self.prefilling if p.row.cancelled]:
            self.prefilling.remove(p)
            self._offer_read(p)
            p.row.stream.finish("cancel")
            self._close(p.row)
        # with no row decoding, a whole chunk a step (the widths one feed of the whole prompt
        # takes), not the whole prompt: a client leaving is seen within a chunk. Once a row
        # is read to decode, no more than a decoding step's share: its first token waits
        budget = PREFILL_CHUNK if self.rows else CHUNK
        joining: list[Joining] = []
        spent = 0
        group = self._row_group()
        if group:
            spent += self._feed_group(group, joining)
            budget = PREFILL_CHUNK
        while self.prefilling and spent < budget:
            p = self.prefilling[0]
            try:
                if p.todo:
                    chunk, p.todo = p.todo[: budget - spent], p.todo[budget - spent :]
                    feed(p.row.gen.target, p.cache, chunk)
                    mx.async_eval([c.state for c in p.cache])  # runs while the next is built
                    p.fed += chunk
                    spent += max(len(chunk), MIN_FORWARD)
                if p.todo:
                    break
                self.prefilling.popleft()
            except Exception as exc:
                self._drop_prefilling(p, exc)
                continue
            joining.append(p.row)
            budget = PREFILL_CHUNK
        return joining

    def _offer_read(self, p: Prefilling) -> None:
        """A prompt cancelled while it was read offers what was read: an editor that cancels
        sends the same prefix again (as Ollama's runner keeps a cancelled sequence's tokens).
        A quantizing row (`kv_bits`) offers a prompt only whole; a failure is a miss."""
        if self.prefix is None or not p.fed or p.row.ns.kv:
            return
        try:
            offer_caches(
                self.prefix, p.row.ns, p.cache, p.fed,
                recompute_rate=self.pairing.costs.recompute_rate,
            )  # fmt: skip
        except Exception:
            log.exception("prefix cache: offering a cancelled prompt failed")

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
            with selecting([p.row.gen.target for p in group]):
                feed_rows(self.pairing.target, [p.cache for p in group], [p.todo for p in group])
            mx.async_eval([c.state for p in group for c in p.cache])
        except Exception as exc:
            for p in group:
                self._drop_prefilling(p, exc)
            return rows * width
        for p in group:
            p.fed, p.todo = p.fed + p.todo, []
            joining.append(p.row)
        return rows * width

    def _drop_prefilling(self, p: Prefilling, exc: Exception) -> None:
        if self.prefilling and self.prefilling[0] is p:
            self.prefilling.popleft()
        self._fail(p.row, exc)

    # -- decoding ------------------------------------------------------------------------------

    def _step(self) -> None:
        """One round: a lone row steps alone (with `LONE_BATCH`, as a batch of one); several
        step as one batch (rows whose caches cannot share a batch cache, e.g. quantized K/V,
        take their own round beside it)."""
        for row in [r for r in self.rows if r.cancelled]:
            self._retire(row, "cancel")
        if len(self.rows) == 1 and not (LONE_BATCH and self._batchable(self.rows[0])):
            row = self.rows[0]
            try:
                if row.batched:
                    self._unbatch(row)
                if not self._push(row, row.gen.step()) and row.unoffered:
                    self.flush()  # the first token goes out before the prompt's offer
                    self._offer_prompt(row)
            except Exception as exc:
                self._fail(row, exc)
            return
        joining: list[Row] = []
        for row in [r for r in self.rows if not r.batched and r.gen.batchable]:
            try:
                if self._push(row, row.gen.settle()):
                    continue
                self._offer_prompt(row)
            except Exception as exc:
                self._fail(row, exc)
                continue
            joining.append(row)
        if joining:
            self.batch.join([r.gen for r in joining])
            for row in joining:
                row.batched = True
        if len(self.batch):
            self._batch_round()
        for row in [r for r in self.rows if not r.batched]:
            try:
                self._offer_prompt(row)
                self._push(row, row.gen.step())
            except Exception as exc:
                self._fail(row, exc)

    @staticmethod
    def _batchable(row: Row) -> bool:
        """In the batch, or its cache can join it (a batched row's cache is the batch's)."""
        return row.batched or row.gen.batchable

    def _batch_round(self) -> None:
        batched = [r for r in self.rows if r.batched]
        try:
            committed = self.batch.round()
        except Exception as exc:  # the batch's forward failed: every row in it ends
            for row in batched:
                self._fail(row, exc)
            return
        by_gen = {id(r.gen): r for r in batched}
        for c in committed:
            row = by_gen[id(c.gen)]
            if c.error is not None:  # that row's own failure: it ends, the batch goes on
                self._fail(row, c.error)
            else:
                self._push(row, c.tokens)

    def _push(self, row: Row, tokens: list[int]) -> bool:
        """Stream a row's new tokens; a finished row retires. True when it did."""
        if row.push(tokens):
            self._retire(row)
            return True
        return False

    def _unbatch(self, row: Row) -> None:
        if row.batched:
            self.batch.leave(row.gen)
            row.batched = False

    # -- the end of a row ----------------------------------------------------------------------

    def _retire(self, row: Row, reason: str | None = None) -> None:
        """Finish a row: final event; its committed state is offered to the prefix cache
        after the response is out (`_offer_finished`)."""
        if row in self.rows:
            self.rows.remove(row)
        try:
            self._unbatch(row)
            row.finish(reason)
            if self.prefix is not None and row.stream.reason == "cancel":
                self._offer_prompt(row)
            elif self.prefix is not None:
                self.finished.append(row)
                return
        except Exception:
            log.exception("finishing a row failed")
        self._close(row)

    def _offer_finished(self, hits_only: bool = False) -> None:
        """Offer finished rows' state to the prefix cache, then close them. A request that
        arrived meanwhile is read first (the loop calls this again once its prompt is
        queued: the offer's syncs then wait on work that prompt needs done anyway), unless
        it would hit what only a finished row's offer adds: that row offers first
        (`hits_only`), so a prompt sent again is restored, not recomputed."""
        if not self.finished:
            return
        self.flush()  # the responses go out before the cache work (a draft may catch up)
        assert self.prefix is not None
        if hits_only:
            prompts = [job.request.prompt_tokens for job in self.waiting]
            block = self.prefix.block
            rows = [r for r in self.finished if any(_gains(r, p, block) for p in prompts)]
        else:
            rows = list(self.finished)
        for row in rows:
            self.finished.remove(row)
            try:
                prompt_len = len(row.request.prompt_tokens)
                idle = not (self.rows or self.waiting or self.prefilling or self.finished)
                idle = idle and self.jobs.empty()
                offer_final(
                    self.prefix, row.ns, row.gen, prompt_len, row.draft_revision,
                    catch_up=idle, recompute_rate=self.pairing.costs.recompute_rate,
                )  # fmt: skip
            except Exception:
                log.exception("finishing a row failed")
            finally:
                self._close(row)

    def _fail(self, row: Row, exc: Exception) -> None:
        """A failure ends that row's stream with an error line, nothing else."""
        log.exception("generation failed", exc_info=exc)
        if row in self.rows:
            self.rows.remove(row)
        try:
            self._unbatch(row)
        except Exception:
            log.exception("dropping a failed row from the batch failed")
        row.job.emit(_failed(exc))
        self._close(row)

    def _close(self, row: Row) -> None:
        try:
            row.gen.close()
        finally:
            for undo in row.release:
                undo()
            row.release.clear()
            row.job.done()


def _failed(exc: Exception) -> Failed:
    """The event that ends a request `exc` ended: the request's own doing where its grammar
    failed, the engine's otherwise."""
    return Failed(str(exc) or type(exc).__name__, by_request=isinstance(exc, GrammarError))


def _gains(row: Row, prompt: Sequence[int], block: int) -> bool:
    """Whether `prompt` could hit blocks that only `row`'s final offer inserts: it begins as
    what the row holds does, over a first prefix-cache block (or all of it, when shorter)
    and past the prompt the row offered after its first token. A prompt sent again right
    after its answer (an editor's retry) hits that offer already: it does not wait on the
    final one's slicing and syncs."""
    held, looked_up = row.gen.tokens, prompt[:-1]  # a lookup reads all but the last token
    n = max(min(block, len(held)), row.offered + 1)
    return 0 < n <= min(len(held), len(looked_up)) and list(looked_up[:n]) == list(held[:n])


def _revision(target: Any) -> str:
    """The adapter part of a row's namespace: its mount's revision, "" on the base."""
    return target.mount.revision if isinstance(target, AdaptedModel) else ""
