"""Work done for a client only while it is there.

A streamed answer notices a departed client when its next write fails (Starlette cancels the
stream); before that, a request waits in the queue for its model, and a non-streamed answer
(the `ollama` Python client's default) is computed whole before anything is written. Neither
writes, so without a watch they would hold a queue place, load a model and decode for
nobody. `while_connected` runs such work beside a watch on the connection and cancels it when
the client goes away (a `ClientDisconnect`, answered 499 and not logged).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

T = TypeVar("T")


async def _gone(request: Request) -> None:
    """Returns once the client has closed its connection (its body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def while_connected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnect once the client goes away first (the work is
    cancelled: a request waiting for its model leaves the queue, a generation ends). Work that
    completes as the client leaves is returned, so nothing it holds is lost."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_gone(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if task.cancelled():
                raise ClientDisconnect()
        return task.result()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
