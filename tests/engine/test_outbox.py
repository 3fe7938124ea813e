"""The runner's outbox: a scheduler step's events reach their loops together, in order."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from mlxd.engine import runner
from mlxd.engine.events import Event, TextChunk
from mlxd.engine.runner import FirstOut, Outbox


def test_events_wait_for_the_flush_and_arrive_in_order() -> None:
    outbox = Outbox()

    async def main() -> list[list[Event]]:
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[Event]] = [asyncio.Queue() for _ in range(3)]
        senders = [outbox.sender(loop, q) for q in queues]

        def step() -> None:  # what a scheduler thread does in one step
            for i in range(4):
                for row, send in enumerate(senders):
                    send(TextChunk(f"{row}:{i}"))

        worker = threading.Thread(target=step)
        worker.start()
        worker.join()
        await asyncio.sleep(0.01)
        assert all(q.empty() for q in queues)  # held until the step's flush
        outbox.flush()
        return [[await q.get() for _ in range(4)] for q in queues]

    got = asyncio.run(main())
    assert got == [[TextChunk(f"{row}:{i}") for i in range(4)] for row in range(3)]


def test_a_closed_loop_does_not_stop_the_others() -> None:
    outbox = Outbox()
    gone = asyncio.new_event_loop()
    gone_queue: asyncio.Queue[Event] = asyncio.Queue()
    outbox.sender(gone, gone_queue)(TextChunk("lost"))
    gone.close()

    async def main() -> Event:
        events: asyncio.Queue[Event] = asyncio.Queue()
        outbox.sender(asyncio.get_running_loop(), events)(TextChunk("kept"))
        outbox.flush()
        return await asyncio.wait_for(events.get(), 5)

    assert asyncio.run(main()) == TextChunk("kept")


def test_a_stream_s_first_event_is_written_before_the_step_goes_on(monkeypatch: Any) -> None:
    """The runner's thread waits for a stream's first event to be passed on (time to first
    token: a thread building the next forward would keep the GIL from the loop), once."""
    monkeypatch.setattr(runner, "FIRST_WAIT", 30.0)  # far longer than any loop turn
    outbox = Outbox()
    first = FirstOut()
    seen: list[bool] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        send = outbox.sender(loop, events, first)

        def step() -> None:
            send(TextChunk("a"))
            outbox.flush()
            seen.append(first.written.is_set())  # the caller had it when the step went on
            send(TextChunk("b"))
            t0 = time.monotonic()
            outbox.flush()  # no caller acknowledges "b": the stream was waited for once
            seen.append(time.monotonic() - t0 < 10.0)

        worker = threading.Thread(target=step)
        worker.start()
        assert await events.get() == TextChunk("a")
        first.written.set()  # what `PairingRunner.generate` does once it passed it on
        assert await events.get() == TextChunk("b")
        await asyncio.to_thread(worker.join)

    asyncio.run(main())
    assert seen == [True, True]


def test_an_unacknowledged_first_event_holds_the_step_for_first_wait_at_most(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(runner, "FIRST_WAIT", 0.05)
    outbox = Outbox()
    gone = asyncio.new_event_loop()  # a caller that never passes anything on
    outbox.sender(gone, asyncio.Queue(), FirstOut())(TextChunk("a"))
    t0 = time.monotonic()
    outbox.flush()
    assert time.monotonic() - t0 >= 0.05
    gone.close()
