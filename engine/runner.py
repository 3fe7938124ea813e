"""One thread per loaded pairing: it loads the models and runs every MLX call for them.

Keeping all of a pairing's MLX work on one thread keeps streams and caches single-owner and the
event loop free. Requests are served in order; events go back to the caller's asyncio queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import mlx.core as mx

from engine.cache_use import has_companion, namespace_for, offer, restore
from engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from engine.events import Done, Event, Failed, GenerationRequest, Metrics, TextChunk
from engine.generation import Generation
from engine.options import SamplingOptions
from engine.pairing import Pairing, load_pairing
from engine.prefix_cache import PrefixCache
from engine.sampling import Rng
from engine.speculation import Costs, DraftLengthController, SpecStats
from engine.textstream import IncrementalDetokenizer, StopMatcher
from registry.schema import ModelEntry

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerationRequest
    emit: Callable[[Event], None]


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
    if method == "lookup" or (pairing.draft is None):
        source, draft_cost = LookupDraftSource(), 0.0
    elif method == "model":
        source = ModelDraftSource(pairing.draft, opts, rng)
    else:
        source = HybridDraftSource(LookupDraftSource(), ModelDraftSource(pairing.draft, opts, rng))
    return source, DraftLengthController(pairing.costs, max_k, draft_cost)


def generation_limit(opts: SamplingOptions, prompt_len: int, context_length: int) -> int:
    num_ctx = min(opts.num_ctx or context_length, context_length)
    room = max(num_ctx - prompt_len, 1)
    return room if opts.num_predict < 0 else min(opts.num_predict, room)


class PairingRunner:
    """Owns one pairing: loads it on its thread, then serves generations one at a time."""

    def __init__(
        self, entry: ModelEntry, costs: Costs | None = None, prefix: PrefixCache | None = None
    ) -> None:
        self.entry = entry
        self.costs = costs
        self.prefix = prefix
        self.pairing: Pairing | None = None
        self.loaded = concurrent.futures.Future[Pairing]()
        self.load_seconds = 0.0
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._active = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=f"runner:{entry.name}", daemon=True)
        self._thread.start()

    # -- thread side -------------------------------------------------------------------------

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.pairing = load_pairing(self.entry, self.costs)
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.load_seconds = time.perf_counter() - t0
        self.loaded.set_result(self.pairing)
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except BaseException as exc:  # the stream must end with an error line, not a crash
                log.exception("generation failed")
                job.emit(Failed(str(exc) or type(exc).__name__))
            finally:
                with self._lock:
                    self._active -= 1
        self.pairing = None
        mx.clear_cache()

    def _run(self, job: _Job) -> None:
        pairing = self.pairing
        assert pairing is not None
        req = job.request
        opts = req.options
        if req.cancel.is_set():
            return
        rng = Rng(opts.seed)
        source, controller = make_draft_source(pairing, opts, rng)
        limit = generation_limit(opts, len(req.prompt_tokens), pairing.context_length)
        ns = namespace_for(pairing, opts, source)
        companion = has_companion(source)
        restored, hit = None, 0
        if self.prefix is not None:
            restored, hit = restore(self.prefix, ns, pairing, req.prompt_tokens, source)
        gen = Generation(
            pairing.target, req.prompt_tokens, opts, pairing.eos_ids, limit, rng,
            source, controller, SpecStats(), cache=restored,
        )  # fmt: skip
        detok = IncrementalDetokenizer(pairing.tokenizer.decode)
        stops = StopMatcher(opts.stop)
        output: list[int] = []
        try:
            t_prompt = time.perf_counter()
            gen.prefill()
            t_eval = time.perf_counter()
            if self.prefix is not None:
                offer(self.prefix, ns, gen, companion)
            for new in gen:
                for tok in new:
                    if tok in pairing.eos_ids:
                        break
                    output.append(tok)
                    text = stops.feed(detok.add(tok))
                    if text:
                        job.emit(TextChunk(text))
                    if stops.stopped:
                        break
                if stops.stopped or req.cancel.is_set():
                    break
            if not stops.stopped:
                tail = stops.feed(detok.flush()) + stops.flush()
                if tail:
                    job.emit(TextChunk(tail))
            t_end = time.perf_counter()
            reason = "stop" if stops.stopped or gen.finish == "stop" else "length"
            metrics = Metrics(
                total_duration=int((t_end - req.started) * 1e9),
                load_duration=int(req.load_duration * 1e9),
                prompt_eval_count=len(req.prompt_tokens),
                prompt_eval_duration=int((t_eval - t_prompt) * 1e9),
                eval_count=len(output),
                eval_duration=int((t_end - t_eval) * 1e9),
            )
            job.emit(Done(reason, metrics, output, gen.stats, hit))
            if self.prefix is not None:
                offer(self.prefix, ns, gen, companion)
        finally:
            gen.close()

    # -- caller side ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._active > 0

    async def wait_loaded(self) -> Pairing:
        return await asyncio.wrap_future(self.loaded)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Stream events for one request; closing the iterator cancels the generation."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        with self._lock:
            self._active += 1
        self._jobs.put(_Job(request, emit))
        try:
            while True:
                event = await events.get()
                yield event
                if isinstance(event, Done | Failed):
                    return
        finally:
            request.cancel.set()

    def stop(self) -> None:
        """Finish queued work, then release the models (the thread exits)."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
