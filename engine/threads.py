"""Threads that run MLX work.

MLX keeps each thread's streams in that thread's own registry and leaves freeing them to the
thread: one that ran MLX work and ends without `mx.clear_streams()` can abort the whole process
at exit ("terminate called without an active exception"). A thread that cleared its streams
cannot run MLX work again, so MLX work never goes to a shared pool thread: each piece gets a
thread of its own that clears its streams as it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

T = TypeVar("T")


def release_streams() -> None:
    """Let the calling thread's queued MLX work finish, then free its streams."""
    with contextlib.suppress(RuntimeError):  # a thread that never ran MLX work has no stream
        mx.synchronize()
    mx.clear_streams()


def start_mlx_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target`, releasing its streams however `target` ends."""

    def main() -> None:
        try:
            target()
        finally:
            release_streams()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    return thread


async def run_in_mlx_thread(fn: Callable[[], T], name: str) -> T:
    """`asyncio.to_thread` for MLX work: `fn` runs on a fresh thread that releases its streams."""
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
