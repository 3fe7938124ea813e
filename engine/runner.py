"""One thread per loaded pairing: it loads the models and runs every MLX call for them.

Keeping all of a pairing's MLX work on one thread keeps streams and caches single-owner and the
event loop free. The thread runs the pairing's Scheduler; events go back to the caller's
asyncio queue.

The thread beats a heartbeat after every scheduler step. A runner that holds requests and has
not beaten for too long is stuck inside a step (the manager's watchdog decides); Python cannot
kill its thread, so `abandon` answers its requests from the caller's side and drops whatever
the thread still produces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import mlx.core as mx

from mlxd.engine.adapters import DEFAULT_ADAPTER_BYTES
from mlxd.engine.backend import Backend
from mlxd.engine.events import Done, Event, Failed, GenerationRequest
from mlxd.engine.memory import return_freed_memory
from mlxd.engine.pairing import Pairing, close_target, load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.progress import beat_with
from mlxd.engine.scheduler import Job, Scheduler
from mlxd.engine.speculation import Costs
from mlxd.engine.threads import start_mlx_thread
from mlxd.registry.schema import ModelEntry

log = logging.getLogger(__name__)

STALL_ENV = "MLXD_TEST_STALL_S"


class TestStall:
    """Test-only: with MLXD_TEST_STALL_S=<seconds> set, the first step of this process that
    hands events to a request then blocks for that long on the runner's thread (a step that
    does not return), once per process, so the watchdog can be exercised on a real model.
    `release` ends the block early (tests, so the thread can finish)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._used = False
        self._lock = threading.Lock()

    @staticmethod
    def seconds() -> float:
        try:
            return max(0.0, float(os.environ.get(STALL_ENV) or 0))
        except ValueError:
            return 0.0

    def block(self, seconds: float) -> None:
        with self._lock:
            if self._used:
                return
            self._used = True
        log.warning("%s: blocking this runner's step for %.1f s", STALL_ENV, seconds)
        self.release.wait(seconds)


TEST_STALL = TestStall()


FIRST_WAIT = 0.003  # the longest a step waits for a stream's first event to be written


class FirstOut:
    """A stream's first event: the caller sets `written` once it has passed it on.

    The runner's thread goes on building the next forward after handing events over, and a
    thread busy in Python keeps the GIL for up to the switch interval (5 ms) before the event
    loop can write anything. For a stream's first event (time to first token) the thread waits
    instead, up to FIRST_WAIT, releasing the GIL; the device runs the forward queued meanwhile."""

    def __init__(self) -> None:
        self.written = threading.Event()
        self.awaited = False  # a flush waits for it once


class Outbox:
    """Events bound for callers' event loops, handed over once per scheduler step.

    Waking a loop costs a syscall and a loop turn; once per token per row, the loop thread then
    takes the GIL from the scheduler's next step every few hundred microseconds.
    """

    def __init__(self) -> None:
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event], Event]] = []
        self._first: list[FirstOut] = []  # first events among those held
        self._lock = threading.Lock()
        self._closed = False  # abandoned runner: what its thread still sends is dropped

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._held, self._first = [], []

    def sender(
        self,
        loop: asyncio.AbstractEventLoop,
        events: asyncio.Queue[Event],
        first: FirstOut | None = None,
    ) -> Callable[[Event], None]:
        def send(event: Event) -> None:
            with self._lock:
                if self._closed:
                    return
                self._held.append((loop, events, event))
                if first is not None and not first.awaited:
                    first.awaited = True
                    self._first.append(first)

        return send

    def flush(self) -> int:
        """Hand the held events over (and wait, briefly, for first events to be written);
        returns how many."""
        with self._lock:
            held, self._held = self._held, []
            first, self._first = self._first, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for loop, events, event in held:
            by_loop.setdefault(loop, []).append((events, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that caller's loop is gone
                loop.call_soon_threadsafe(_deliver, items)
        deadline = time.monotonic() + FIRST_WAIT
        for out in first:
            out.written.wait(max(0.0, deadline - time.monotonic()))
        return len(held)


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
        adapter_bytes: int = DEFAULT_ADAPTER_BYTES,
    ) -> None:
        self.entry = entry
        self.backend = backend
        self.costs = costs
        self.prefix = prefix
        self.num_parallel = num_parallel
        self.adapter_bytes = adapter_bytes
        self.pairing: Pairing | None = None
        self.scheduler: Scheduler | None = None
        self.loaded = concurrent.futures.Future[Pairing]()
        # running: a waiter that leaves cancels its own wait, never the load the others await
        self.loaded.set_running_or_notify_cancel()
        self.load_seconds = 0.0
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._outbox = Outbox()
        self._active = 0
        self._lock = threading.Lock()
        # callers waiting for events: what `abandon` answers when the thread cannot
        self._callers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]]] = {}
        self.abandoned = False
        self.heartbeat = time.monotonic()  # the last step's end (or a request to an idle runner)
        self._test_stall = TestStall.seconds()
        self._work = start_mlx_thread(self._main, f"runner:{entry.name}")

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.pairing = load_pairing(self.entry, self.backend, self.costs, self.adapter_bytes)
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.scheduler = Scheduler(
            self.pairing, self._jobs, self.prefix, self.num_parallel, self._stepped
        )
        try:
            self.scheduler.warm()
        except Exception:
            log.exception("warming the batch of %s failed", self.entry.name)
        self.load_seconds = time.perf_counter() - t0
        self.heartbeat = time.monotonic()
        beat_with(self._beat)
        self.loaded.set_result(self.pairing)
        try:
            self.scheduler.run()
        except BaseException:
            log.exception("scheduler of %s stopped", self.entry.name)
        finally:
            self._outbox.flush()
            self.scheduler = None
            if self.pairing is not None:
                close_target(self.pairing.target)
            self.pairing = None
            mx.clear_cache()
            return_freed_memory()

    def _beat(self) -> None:
        self.heartbeat = time.monotonic()

    def _stepped(self) -> None:
        """After every scheduler step, on this thread: the heartbeat, then the step's events."""
        self.heartbeat = time.monotonic()
        if self._outbox.flush() and self._test_stall:
            TEST_STALL.block(self._test_stall)

    # -- caller side ---------------------------------------------------------------------------

    def stalled_for(self, now: float) -> float:
        """Seconds this runner has held requests without finishing a step (0 while it is
        idle, loading, or abandoned already)."""
        if self.abandoned or self._active <= 0 or not self.loaded.done():
            return 0.0
        return max(0.0, now - self.heartbeat)

    def abandon(self, message: str) -> int:
        """Give up on a runner whose thread is stuck in a step: every request it holds ends
        with `message` (delivered from here, since the thread cannot), and what the thread
        still produces is dropped. The thread is told to stop and exits if its step ever
        returns. Returns how many requests were answered."""
        with self._lock:
            self.abandoned = True
            callers, self._callers = list(self._callers.values()), {}
        self._outbox.close()
        for loop, events in callers:
            with contextlib.suppress(RuntimeError):  # that caller's loop is gone
                loop.call_soon_threadsafe(events.put_nowait, Failed(message))
        self._jobs.put(None)
        return len(callers)

    def end_requests(self, message: str) -> int:
        """End every request this runner holds with `message` (the daemon is stopping); each
        one's row is cancelled as its caller stops reading. Returns how many."""
        with self._lock:
            callers = list(self._callers.values())
        for loop, events in callers:
            with contextlib.suppress(RuntimeError):  # that caller's loop is gone
                loop.call_soon_threadsafe(events.put_nowait, Failed(message, closing=True))
        return len(callers)

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
        loop = asyncio.get_running_loop()
        first = FirstOut()
        emit = self._outbox.sender(loop, events, first)
        key = id(events)
        with self._lock:
            taken = not self.abandoned
            if taken:
                if self._active <= 0:  # an idle runner's clock starts with its next request
                    self.heartbeat = time.monotonic()
                self._active += 1
                self._callers[key] = (loop, events)
                self._jobs.put(Job(request, emit, self._finished))
        if not taken:
            yield Failed(f"model '{self.entry.name}' stopped responding; please retry")
            return
        try:
            while True:
                event = await events.get()
                yield event  # returns once the caller has passed it on
                first.written.set()
                if isinstance(event, Done | Failed):
                    return
        finally:
            with self._lock:
                self._callers.pop(key, None)
            request.cancel.set()

    def stop(self) -> None:
        """Finish queued work, then release the models (the thread exits)."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to exit; True once it has."""
        self._work.join(timeout)
        return not self._work.is_alive()
