"""MLX work runs on pooled threads that are reused, never ended: MLX leaves a thread's stream
workers running for good, so a thread per piece of work would grow the process forever."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import weakref
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd.engine import attention
from mlxd.engine.backend import configure_backend
from mlxd.engine.progress import beat_with
from mlxd.engine.runner import PairingRunner
from mlxd.engine.threads import pool_size, run_in_mlx_thread, start_mlx_thread, thread_stream
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import TinyPair


def _sum_on_current_thread() -> tuple[str, float]:
    return threading.current_thread().name, mx.sum(mx.arange(10)).item()


def test_run_in_mlx_thread_returns_the_result_on_a_thread_named_for_the_work() -> None:
    async def two() -> list[tuple[str, float]]:
        return [await run_in_mlx_thread(_sum_on_current_thread, f"work:{i}") for i in range(2)]

    assert asyncio.run(two()) == [("work:0", 45.0), ("work:1", 45.0)]


def test_run_in_mlx_thread_raises_what_the_work_raised() -> None:
    def fail() -> None:
        mx.eval(mx.ones(3))
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        asyncio.run(run_in_mlx_thread(fail, "fail"))


def test_work_after_work_reuses_the_thread_and_its_stream() -> None:
    seen: list[tuple[int, str]] = []

    def work() -> None:
        with mx.stream(thread_stream()):
            mx.eval(mx.ones(4) * 2)
        seen.append((threading.get_ident(), str(thread_stream())))

    for i in range(5):
        start_mlx_thread(work, f"work:{i}").join(10)
    assert len(seen) == 5 and len(set(seen)) == 1


def test_work_at_once_takes_threads_of_its_own_and_the_pool_keeps_them() -> None:
    started, go = threading.Barrier(3, timeout=10), threading.Event()
    idents: list[int] = []

    def work() -> None:
        started.wait()
        go.wait(10)
        idents.append(threading.get_ident())

    works = [start_mlx_thread(work, f"at-once:{i}") for i in range(2)]
    started.wait()
    assert all(w.is_alive() for w in works)
    go.set()
    for w in works:
        w.join(10)
    assert not any(w.is_alive() for w in works)
    assert len(set(idents)) == 2
    size = pool_size()
    for i in range(2):
        start_mlx_thread(work, f"again:{i}")
    started.wait()
    assert pool_size() == size  # the two idle threads took the new work


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_the_process_keeps_its_thread_count() -> None:
    def work() -> None:
        with mx.stream(thread_stream()):
            mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))

    start_mlx_thread(work, "first").join(10)
    before = len(os.listdir("/proc/self/task"))
    for i in range(10):
        start_mlx_thread(work, f"work:{i}").join(10)
    assert len(os.listdir("/proc/self/task")) == before


def test_a_failure_is_logged_and_the_thread_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    def fail() -> None:
        raise RuntimeError("broken")

    with caplog.at_level(logging.ERROR, logger="mlxd.engine.threads"):
        start_mlx_thread(fail, "fails").join(10)
    assert "MLX work fails failed" in caplog.text
    got: list[tuple[str, float]] = []
    start_mlx_thread(lambda: got.append(_sum_on_current_thread()), "after").join(10)
    assert got == [("after", 45.0)]


class _Held:
    """Stands for what a piece of work holds (a runner, and through it a model's weights)."""


def test_what_work_kept_per_thread_goes_with_it() -> None:
    """A pooled thread outlives its work: neither the work itself nor what it kept per thread
    (a runner's beat) may keep the work's objects alive, and the next work on the thread
    starts as on a fresh one (no warm-up seen: a probe measures with MLX's own attention)."""

    def run_holding() -> weakref.ref[_Held]:
        held = _Held()

        def work() -> None:
            beat_with(lambda: print(held))  # a runner installs its beat
            with attention.warming():
                pass

        start_mlx_thread(work, "runner").join(10)
        return weakref.ref(held)

    ref = run_holding()
    seen: list[bool] = []
    start_mlx_thread(lambda: seen.append(attention._warmed.ran), "probe").join(10)
    gc.collect()
    assert ref() is None
    assert seen == [False]


def test_an_unloaded_model_is_freed_on_its_pooled_thread(tiny_pair: TinyPair) -> None:
    """The runner's model is gone once it stops, though its thread serves on."""
    entry = ModelEntry(name="tiny", target=str(tiny_pair.target), draft=str(tiny_pair.draft))
    runner = PairingRunner(entry, configure_backend(), None, None, 1)
    pairing = weakref.ref(runner.loaded.result(120))
    runner.stop()
    assert runner.join(60)
    del runner
    gc.collect()
    assert pairing() is None


def test_a_caller_that_leaves_does_not_break_the_work() -> None:
    """A cancelled await lets the running work finish quietly (the probe of a model whose
    request went away)."""
    started, finish, finished = threading.Event(), threading.Event(), threading.Event()
    done: list[float] = []

    def slow() -> float:
        started.set()
        finish.wait(10)
        done.append(mx.sum(mx.ones(4)).item())
        finished.set()
        return done[-1]

    async def leave() -> None:
        task = asyncio.ensure_future(run_in_mlx_thread(slow, "slow"))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(leave())
    finish.set()
    assert finished.wait(10)
    assert done == [4.0]
