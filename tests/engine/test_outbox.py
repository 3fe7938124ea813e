"""The runner's outbox: a scheduler step's events reach their loops together, in order."""

from __future__ import annotations

import asyncio
import threading

from mlxd.engine.events import Event, TextChunk
from mlxd.engine.runner import Outbox


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
