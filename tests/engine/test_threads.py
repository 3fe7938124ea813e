"""MLX work runs on threads of its own that free their streams as they end."""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest

from mlxd.engine.threads import release_streams, run_in_mlx_thread, start_mlx_thread


def _sum_on_current_thread() -> tuple[str, float]:
    return threading.current_thread().name, mx.sum(mx.arange(10)).item()


def test_run_in_mlx_thread_returns_the_result_from_a_fresh_thread() -> None:
    async def two() -> list[tuple[str, float]]:
        return [await run_in_mlx_thread(_sum_on_current_thread, f"work:{i}") for i in range(2)]

    assert asyncio.run(two()) == [("work:0", 45.0), ("work:1", 45.0)]


def test_run_in_mlx_thread_raises_what_the_work_raised() -> None:
    def fail() -> None:
        mx.eval(mx.ones(3))
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        asyncio.run(run_in_mlx_thread(fail, "fail"))


def test_a_released_thread_has_no_stream_left() -> None:
    """The release really frees the thread's streams: MLX work after it fails on that thread."""
    seen: list[str] = []

    def work_then_release() -> None:
        mx.eval(mx.ones(3) * 2)
        release_streams()
        try:
            mx.eval(mx.ones(3) * 2)
        except RuntimeError as exc:
            seen.append(str(exc))

    start_mlx_thread(work_then_release, "released").join()
    assert seen and "Stream" in seen[0]


def test_release_on_a_thread_that_never_ran_mlx_work() -> None:
    start_mlx_thread(lambda: None, "idle").join()  # no stream to wait for: no error


def test_a_caller_that_leaves_does_not_break_the_work() -> None:
    """A cancelled await lets the running work finish quietly (the probe of a model whose
    request went away)."""
    started, finish = threading.Event(), threading.Event()
    done: list[float] = []

    def slow() -> float:
        started.set()
        finish.wait(10)
        done.append(mx.sum(mx.ones(4)).item())
        return done[-1]

    async def leave() -> None:
        task = asyncio.ensure_future(run_in_mlx_thread(slow, "slow"))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    errors: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)  # type: ignore[assignment]
    try:
        asyncio.run(leave())
        finish.set()
        for t in threading.enumerate():
            if t.name == "slow":
                t.join(10)
    finally:
        threading.excepthook = hook
    assert done == [4.0]
    assert errors == []
