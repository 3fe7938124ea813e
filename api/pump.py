"""The event pump: one engine generation turned into a stream of wire chunks, for /api (NDJSON)
and /v1 (server-sent events) alike.

A route says how its text, final and error objects look (a `Writer`); the pump owns the rest:
the order of events, the error object that ends a stream which fails (a stream never dies with
a broken connection or a 500 once its headers are out), cancelling the engine's row when the
client goes away, and releasing the model in every case.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

from mlxd.api.errors import GenerationFailed, GenerationRefused, message_of
from mlxd.engine.events import Done, Failed, GenerationRequest, TextChunk
from mlxd.engine.logprobs import Logprob
from mlxd.engine.manager import Loaded, ModelManager, ServerClosing

log = logging.getLogger(__name__)

NO_RESULT = "generation ended without a result"


class Writer(Protocol):
    """How one route writes a stream's pieces as bytes."""

    def text(self, text: str, logprobs: tuple[Logprob, ...] = ()) -> bytes: ...

    def done(self, done: Done) -> Iterable[bytes]: ...

    def failed(self, message: str) -> bytes: ...


async def pump(
    manager: ModelManager, slot: Loaded, gen: GenerationRequest, writer: Writer
) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for event in manager.generate(slot, gen):
            if isinstance(event, TextChunk):
                piece = writer.text(event.text, event.logprobs)
                if piece:  # a parser may hold text back (a tool call in progress)
                    yield piece
            elif isinstance(event, Done):
                for piece in writer.done(event):
                    if piece:
                        yield piece
                finished = True
            elif isinstance(event, Failed):
                yield writer.failed(event.message)
                finished = True
        if not finished:
            yield writer.failed(NO_RESULT)
    except Exception as exc:  # never a broken connection: an error object ends the stream
        log.exception("stream failed")
        yield writer.failed(message_of(exc))
    finally:
        gen.cancel.set()
        manager.release(slot)


@dataclass(frozen=True)
class Answer:
    """A whole (non-streamed) generation."""

    text: str
    done: Done
    logprobs: tuple[Logprob, ...] = ()  # every token's, when the request asked for them


async def collect(manager: ModelManager, slot: Loaded, gen: GenerationRequest) -> Answer:
    """Run the generation to its end; an engine failure is a GenerationFailed (500), one the
    request's own input caused a GenerationRefused (400), the daemon stopping ServerClosing
    (503). Cancelled (the client left), the engine's row ends too."""
    parts: list[str] = []
    logprobs: list[Logprob] = []
    try:
        async for event in manager.generate(slot, gen):
            if isinstance(event, TextChunk):
                parts.append(event.text)
                logprobs += event.logprobs
            elif isinstance(event, Failed):
                if event.closing:
                    raise ServerClosing()  # 503, as a request still waiting is answered
                raise (GenerationRefused if event.by_request else GenerationFailed)(event.message)
            elif isinstance(event, Done):
                return Answer("".join(parts), event, tuple(logprobs))
    finally:
        gen.cancel.set()
        manager.release(slot)
    raise GenerationFailed(NO_RESULT)
