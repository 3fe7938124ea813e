"""Model management routes: ``POST /api/pull`` (progress stream), ``DELETE /api/delete`` and
``POST /api/copy``, with Ollama's bodies, statuses and error messages (reference §1.8-1.11)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxd.api.codec import NDJSON, ndjson_line, read_request
from mlxd.api.errors import ApiError, status_of
from mlxd.api.state import CLOSING, ServerState, state_of
from mlxd.api.types import CopyRequest, ErrorResponse, ModelRequest
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.pull import (
    DeleteError,
    Progress,
    PullCancelled,
    PullError,
    copy_model,
    delete_model,
    user_file_in_use,
)
from mlxd.registry.pull import pull as pull_progress
from mlxd.registry.registry import Registry
from mlxd.registry.schema import RegistryError

log = logging.getLogger(__name__)

__all__ = ["copy", "delete", "pull", "routes"]


def _message(exc: BaseException) -> str:
    if not isinstance(exc, (PullError, RegistryError)):
        log.error("pull failed", exc_info=exc)
    return str(exc) or type(exc).__name__


def _progress(
    state: ServerState, name: str, registry: Registry, cancel: threading.Event
) -> Iterator[Progress]:
    """The pull's progress; the registry is reloaded before ``success`` goes out, so the
    model can be used as soon as the client sees it."""
    for item in pull_progress(name, registry=registry, cancel=cancel):
        if item.status == "success":
            error = state.reload()
            if isinstance(error, Exception):
                raise PullError(f"pulled {name}, but the registry could not be reloaded: {error}")
        yield item


CANCEL_CHECK_S = 0.1  # how often a pull waiting on its thread looks at its cancel flag


async def _bridge(
    produce: Callable[[], Iterator[Progress]], cancel: threading.Event
) -> AsyncIterator[Progress | BaseException]:
    """Run a blocking generator in a thread and hand its items (then its error) to async code.

    Closing this async iterator early (the client went away) sets ``cancel``; the thread then
    closes the generator, which stops the download and keeps what arrived for the next pull.
    ``cancel`` set from outside (the daemon stopping) ends the iteration at once, not when the
    thread next gets past a slow read.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Progress | BaseException | None] = asyncio.Queue()

    def put(item: Progress | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed under us (shutdown)
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def run() -> None:
        items = produce()
        try:
            for item in items:
                put(item)
                if cancel.is_set():
                    break
        except BaseException as exc:
            put(exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            put(None)

    threading.Thread(target=run, name="mlxd-pull", daemon=True).start()
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), CANCEL_CHECK_S)
            except TimeoutError:
                if cancel.is_set():
                    return
                continue
            if item is None:
                return
            yield item
            if isinstance(item, BaseException):
                return
    finally:
        cancel.set()


async def pull(request: Request) -> Response:
    state = state_of(request)
    body = await read_request(request, ModelRequest, state.max_body)
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model is required")
    try:
        parse_name(name)
    except InvalidModelName as exc:
        raise ApiError(400, "invalid model name") from exc
    stream = body.stream is not False
    registry = state.registry()
    cancel = threading.Event()

    def produce() -> Iterator[Progress]:
        return _progress(state, name, registry, cancel)

    def failure(exc: BaseException) -> tuple[int, str]:
        """The daemon stopping cancels its pulls: that is what the client hears."""
        if state.closing.is_set():
            return 503, CLOSING
        return status_of(exc), _message(exc)

    async def items() -> AsyncIterator[Progress | BaseException]:
        state.pulls.add(cancel)
        ended = False
        try:
            if state.closing.is_set():
                cancel.set()
            async for item in _bridge(produce, cancel):
                ended = isinstance(item, BaseException) or item.status == "success"
                yield item
            if not ended and state.closing.is_set():
                yield PullCancelled()  # the stop cut the download short
        finally:
            state.pulls.discard(cancel)

    if not stream:
        last: Progress | None = None
        async for item in items():
            if isinstance(item, BaseException):
                raise ApiError(*failure(item))
            last = item
        if last is None:
            raise ApiError(500, "pull ended without a result")
        return JSONResponse(last.as_dict())

    async def lines() -> AsyncIterator[bytes]:
        async for item in items():
            if isinstance(item, BaseException):
                yield ndjson_line(ErrorResponse(failure(item)[1]))
            else:
                yield ndjson_line(item.as_dict())

    return StreamingResponse(lines(), media_type=NDJSON)


async def delete(request: Request) -> Response:
    """Take the model's entry out of the user registry, delete its downloaded files (see
    :func:`mlxd.registry.pull.delete_model` for entries from other registry files), then
    unload it."""
    state = state_of(request)
    body = await read_request(request, ModelRequest, state.max_body)
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model is required")
    registry = state.registry()
    try:
        entry = registry.get(name)
    except InvalidModelName as exc:
        raise ApiError(400, f'name "{name}" is invalid') from exc
    if entry is None:
        raise ApiError(404, f"model '{name}' not found")
    try:
        await run_in_threadpool(delete_model, entry, registry)
    except DeleteError as exc:
        if exc.status == 404:
            raise ApiError(404, f"model '{name}' not found") from exc
        raise ApiError(exc.status, str(exc)) from exc
    except (RegistryError, OSError) as exc:
        raise ApiError(500, str(exc)) from exc
    state.manager.unload(entry.name, shared=True)  # once deleted: a refused delete changes nothing
    await run_in_threadpool(state.reload)
    return Response(status_code=200)


async def copy(request: Request) -> Response:
    """Register ``destination`` in the user registry with ``source``'s entry fields."""
    state = state_of(request)
    body = await read_request(request, CopyRequest, state.max_body)
    source = body.source or ""
    destination = body.destination or ""
    for label, value in (("source", source), ("destination", destination)):
        try:
            parse_name(value)
        except InvalidModelName as exc:
            raise ApiError(400, f'{label} "{value}" is invalid') from exc
    registry = state.registry()
    entry = registry.get(source)
    if entry is None:
        raise ApiError(404, f'model "{source}" not found')
    if not user_file_in_use(registry):
        paths = ", ".join(str(p) for p in registry.paths)
        raise ApiError(
            400, f"cannot copy: the server reads its models from {paths} only (--registry)"
        )
    try:
        await run_in_threadpool(copy_model, entry, destination, registry)
    except (RegistryError, OSError) as exc:
        raise ApiError(500, str(exc)) from exc
    await run_in_threadpool(state.reload)
    return Response(status_code=200)


def routes() -> list[Route]:
    return [
        Route("/api/pull", pull, methods=["POST"]),
        Route("/api/delete", delete, methods=["DELETE"]),
        Route("/api/copy", copy, methods=["POST"]),
    ]
