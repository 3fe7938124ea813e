"""Threads that run MLX work, kept and reused.

MLX gives every stream a worker thread of its own, and a thread's default stream is made the
first time it runs MLX work. Neither worker ever ends: `mx.clear_streams()` frees a thread's
streams but leaves their workers, and a thread that cleared its streams cannot run MLX work
again. A thread per piece of work therefore left one or two threads behind every time, so a
daemon that loads and unloads models (`keep_alive: 0`, switching models) grew without bound
(macOS refuses a process more than 2,048 threads). MLX work instead runs on pooled threads that
never end: a piece of work takes an idle one (or a new one when none is idle) and hands it back
when it ends, and a thread makes its own stream once (`thread_stream`). The pool is as large as
the most pieces ever run at once (loaded models, probes, the SSD writer).

A thread that holds streams when the process exits is harmless as long as it never ends; the
pool's threads are daemon threads waiting for work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")
log = logging.getLogger(__name__)

IDLE_NAME = "mlx-idle"


@dataclass(eq=False)
class MlxWork:
    """One piece of MLX work on a pooled thread: `join` and `is_alive` follow the work, not the
    thread, which goes back to the pool when the work ends."""

    name: str
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class _Worker:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.jobs: queue.SimpleQueue[tuple[Callable[[], None], MlxWork]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name=IDLE_NAME, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        thread = threading.current_thread()
        while True:
            work = self._run(self.jobs.get())  # its frame, holding the target, has ended
            thread.name = IDLE_NAME
            self.pool.idle(self)  # back before `done`: who waited can take it again
            work._done.set()

    def _run(self, job: tuple[Callable[[], None], MlxWork]) -> MlxWork:
        target, work = job
        threading.current_thread().name = work.name
        try:
            target()
        except BaseException:
            log.exception("MLX work %s failed", work.name)
        for step in (settle_streams, *_RESETS):  # the queued work, what it kept per thread
            try:
                step()
            except Exception:  # (a device error surfacing at a sync): the thread serves on
                log.exception("after MLX work %s", work.name)
        return work


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self.size = 0  # threads made, all alive

    def run(self, target: Callable[[], None], name: str) -> MlxWork:
        work = MlxWork(name)
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self)  # (a system out of threads raises here, counting nothing)
            with self._lock:
                self.size += 1
        worker.jobs.put((target, work))
        return work

    def idle(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)


_POOL = _Pool()
_local = threading.local()
_RESETS: list[Callable[[], None]] = []


def reset_after_work(reset: Callable[[], None]) -> Callable[[], None]:
    """Register what clears a module's per-thread state when a piece of work ends: the next
    piece on the thread starts clean, and nothing the work held (a runner, and through it a
    model's weights) outlives it on the pooled thread."""
    _RESETS.append(reset)
    return reset


def pool_size() -> int:
    """Threads the pool holds (busy and idle)."""
    return _POOL.size


def settle_streams() -> None:
    """Let the calling thread's queued MLX work finish, on its default stream and its own."""
    with contextlib.suppress(RuntimeError):  # a thread that never ran MLX work has no stream
        mx.synchronize()
    for stream in _local.__dict__.get("streams", {}).values():
        mx.synchronize(stream)


def thread_stream() -> mx.Stream:
    """A stream of the calling thread's own on the default device, made once per thread (a new
    stream per model would start a worker thread MLX never ends)."""
    streams: dict[str, mx.Stream] = _local.__dict__.setdefault("streams", {})
    device = mx.default_device()
    key = str(device)
    if key not in streams:
        streams[key] = mx.new_stream(device)
    return streams[key]


def start_mlx_thread(target: Callable[[], None], name: str) -> MlxWork:
    """Run `target` on a pooled MLX thread (named `name` while it runs)."""
    return _POOL.run(target, name)


async def run_in_mlx_thread(fn: Callable[[], T], name: str) -> T:
    """`asyncio.to_thread` for MLX work: `fn` runs on a pooled MLX thread."""
    result: concurrent.futures.Future[T] = concurrent.futures.Future()

    def main() -> None:
        if not result.set_running_or_notify_cancel():
            return  # the caller left before the thread started
        try:
            result.set_result(fn())
        except BaseException as exc:
            result.set_exception(exc)

    start_mlx_thread(main, name)
    return await asyncio.wrap_future(result)
