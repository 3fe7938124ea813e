"""One thread per loaded embedding model: it loads the model and runs every forward for it.

Requests that arrive while a forward runs wait in the queue and are then embedded together
(their inputs mixed into the same length-sorted batches), so concurrent clients share
forwards as rows of a generation batch do. The manager drives this runner as it drives a
`PairingRunner` (load, keep_alive, unload, the stall watchdog).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlxd.engine.backend import Backend
from mlxd.engine.embedding.model import (
    Embedded,
    Embedder,
    EmbeddingStopped,
    EmbedRequest,
    load_embedder,
)
from mlxd.engine.embedding.pooling import truncate_dimensions
from mlxd.engine.embedding.spec import EmbeddingSpec
from mlxd.engine.memory import return_freed_memory
from mlxd.engine.progress import beat_with
from mlxd.engine.threads import start_mlx_thread
from mlxd.registry.schema import ModelEntry

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EmbedJob:
    request: EmbedRequest
    future: concurrent.futures.Future[Embedded] = field(default_factory=concurrent.futures.Future)
    gone: threading.Event = field(default_factory=threading.Event)  # its caller stopped waiting


def _settle(job: EmbedJob, outcome: Embedded | BaseException) -> None:
    """Answer `job` unless it was answered already (an abandoned runner's caller was)."""
    try:
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass


class EmbeddingRunner:
    """Owns one embedding model on its thread; `embed` hands it a request."""

    pairing = None  # never a generation pairing (the manager asks)

    def __init__(self, entry: ModelEntry, backend: Backend, spec: EmbeddingSpec) -> None:
        self.entry = entry
        self.backend = backend
        self.spec = spec
        self.embedder: Embedder | None = None
        self.loaded = concurrent.futures.Future[Embedder]()
        # running: a waiter that leaves cancels its own wait, never the load the others await
        self.loaded.set_running_or_notify_cancel()
        self.load_seconds = 0.0
        self.abandoned = False
        self.heartbeat = time.monotonic()
        self._jobs: queue.Queue[EmbedJob | None] = queue.Queue()
        self._active = 0
        self._current: list[EmbedJob] = []  # the jobs of the forward running now
        self._lock = threading.Lock()
        self._work = start_mlx_thread(self._main, f"embedder:{entry.name}")

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.embedder = load_embedder(self.entry, self.backend)
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.load_seconds = time.perf_counter() - t0
        beat_with(self._beat)  # every forward of a long request is progress
        self.loaded.set_result(self.embedder)
        try:
            while self._serve(self.embedder):
                pass
        finally:
            self.embedder = None
            mx.clear_cache()
            return_freed_memory()

    def _serve(self, embedder: Embedder) -> bool:
        """Embed every job waiting now in shared forwards; False once told to stop."""
        first = self._jobs.get()
        jobs, stop = [first], first is None
        while not stop:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            jobs.append(job)
            stop = job is None
        live = [j for j in jobs if j is not None]
        self._current = live
        try:
            self._run(live, embedder)
        finally:
            self._current = []
        return not stop

    def _run(self, jobs: list[EmbedJob], embedder: Embedder) -> None:
        t0 = time.perf_counter()
        tokenized: list[tuple[EmbedJob, list[list[int]]]] = []
        for job in jobs:
            try:
                if not job.future.set_running_or_notify_cancel():
                    continue
            except RuntimeError:  # answered meanwhile (the daemon stopping, the runner abandoned)
                continue
            try:
                tokenized.append((job, embedder.tokenize(job.request, job.gone.is_set)))
            except Exception as exc:  # its input, or its client left: it alone ends
                _settle(job, exc)
        if not tokenized:
            return
        inputs = [ids for _, batch in tokenized for ids in batch]
        try:  # a forward whose every caller left stops between its batches
            vectors = embedder.vectors(inputs, lambda: all(j.gone.is_set() for j, _ in tokenized))
        except EmbeddingStopped as exc:
            for job, _ in tokenized:
                _settle(job, exc)
            return
        except Exception as exc:
            log.exception("embedding forward of %s failed", self.entry.name)
            for job, _ in tokenized:
                _settle(job, exc)
            return
        seconds = time.perf_counter() - t0
        start = 0
        for job, batch in tokenized:
            mine = vectors[start : start + len(batch)]
            start += len(batch)
            vectors_of_job = truncate_dimensions(mine, job.request.dimensions)
            counts = tuple(len(ids) for ids in batch)
            _settle(job, Embedded(vectors_of_job, counts, seconds))
        self._beat()

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    # -- caller side ---------------------------------------------------------------------------

    async def embed(self, request: EmbedRequest) -> Embedded:
        job = EmbedJob(request)
        with self._lock:
            if self.abandoned:
                raise RuntimeError(f"model '{self.entry.name}' stopped responding; please retry")
            if self._active <= 0:
                self.heartbeat = time.monotonic()
            self._active += 1
        try:
            self._jobs.put(job)
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.gone.set()
            raise
        finally:
            with self._lock:
                self._active -= 1

    def stalled_for(self, now: float) -> float:
        if self.abandoned or self._active <= 0 or not self.loaded.done():
            return 0.0
        return max(0.0, now - self.heartbeat)

    def abandon(self, message: str) -> int:
        """Fail every queued request with `message`; the thread exits if its forward returns."""
        self.abandoned = True
        answered = self._fail_all(lambda: RuntimeError(message))
        self._jobs.put(None)
        return answered

    def end_requests(self, error: Callable[[], BaseException]) -> int:
        """The daemon is stopping: answer the running and queued requests with `error()` now
        (the forward stops between its batches), not at the server's shutdown timeout."""
        return self._fail_all(error)

    def _fail_all(self, error: Callable[[], BaseException]) -> int:
        answered = 0
        for running in list(self._current):
            if not running.future.done():
                running.gone.set()
                _settle(running, error())
                answered += 1
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                _settle(job, error())
                answered += 1
            elif job is None:
                self._jobs.put(None)  # a stop already asked for stays asked
                break
        return answered

    @property
    def busy(self) -> bool:
        return self._active > 0

    @property
    def running_rows(self) -> int:
        return self._active

    async def wait_loaded(self) -> Embedder:
        return await asyncio.wrap_future(self.loaded)

    def stop(self) -> None:
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        self._work.join(timeout)
        return not self._work.is_alive()
