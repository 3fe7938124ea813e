"""One thread per loaded pairing: it loads the models and runs every MLX call for them.

Keeping all of a pairing's MLX work on one thread keeps streams and caches single-owner and the
event loop free. The thread runs the pairing's Scheduler; events go back to the caller's
asyncio queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import mlx.core as mx

from mlxd.engine.backend import Backend
from mlxd.engine.events import Done, Event, Failed, GenerationRequest
from mlxd.engine.pairing import Pairing, load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.scheduler import Job, Scheduler
from mlxd.engine.speculation import Costs
from mlxd.engine.threads import start_mlx_thread
from mlxd.registry.schema import ModelEntry

log = logging.getLogger(__name__)


class Outbox:
    """Events bound for callers' event loops, handed over once per scheduler step.

    Waking a loop costs a syscall and a loop turn; once per token per row, the loop thread then
    takes the GIL from the scheduler's next step every few hundred microseconds.
    """

    def __init__(self) -> None:
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event], Event]] = []
        self._lock = threading.Lock()

    def sender(
        self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Event]
    ) -> Callable[[Event], None]:
        def send(event: Event) -> None:
            with self._lock:
                self._held.append((loop, events, event))

        return send

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for loop, events, event in held:
            by_loop.setdefault(loop, []).append((events, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that caller's loop is gone
                loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for events, event in items:
        events.put_nowait(event)


class PairingRunner:
    """Owns one pairing: loads it on its thread, then schedules its requests."""

    def __init__(
        self,
        entry: ModelEntry,
        backend: Backend,
        costs: Costs | None = None,
        prefix: PrefixCache | None = None,
        num_parallel: int = 4,
    ) -> None:
        self.entry = entry
        self.backend = backend
        self.costs = costs
        self.prefix = prefix
        self.num_parallel = num_parallel
        self.pairing: Pairing | None = None
        self.scheduler: Scheduler | None = None
        self.loaded = concurrent.futures.Future[Pairing]()
        self.load_seconds = 0.0
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._outbox = Outbox()
        self._active = 0
        self._lock = threading.Lock()
        self._thread = start_mlx_thread(self._main, f"runner:{entry.name}")

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.pairing = load_pairing(self.entry, self.backend, self.costs)
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.scheduler = Scheduler(
            self.pairing, self._jobs, self.prefix, self.num_parallel, self._outbox.flush
        )
        try:
            self.scheduler.warm()
        except Exception:
            log.exception("warming the batch of %s failed", self.entry.name)
        self.load_seconds = time.perf_counter() - t0
        self.loaded.set_result(self.pairing)
        try:
            self.scheduler.run()
        except BaseException:
            log.exception("scheduler of %s stopped", self.entry.name)
        finally:
            self._outbox.flush()
            self.scheduler = None
            self.pairing = None
            mx.clear_cache()

    # -- caller side ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._active > 0

    @property
    def running_rows(self) -> int:
        scheduler = self.scheduler
        return len(scheduler.rows) if scheduler is not None else 0

    async def wait_loaded(self) -> Pairing:
        return await asyncio.wrap_future(self.loaded)

    def _finished(self) -> None:
        with self._lock:
            self._active -= 1

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Stream events for one request; closing the iterator cancels the generation."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        emit = self._outbox.sender(asyncio.get_running_loop(), events)
        with self._lock:
            self._active += 1
        self._jobs.put(Job(request, emit, self._finished))
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
