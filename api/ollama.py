"""Ollama's native routes: version, tags, show, generate and chat."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mlxd.api.durations import DurationError, parse_keep_alive
from mlxd.api.errors import ApiError, field, read_json
from mlxd.api.modelinfo import find_local, show_json, tag_json
from mlxd.engine.events import Done, Failed, GenerationRequest, TextChunk
from mlxd.engine.manager import Loaded, ModelManager, QueueFull
from mlxd.engine.options import OptionsError, SamplingOptions, parse_options
from mlxd.engine.pairing import ModelUnavailable, Pairing
from mlxd.engine.prompt import PromptError, encode, render_chat, render_generate, with_system
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry

log = logging.getLogger(__name__)

VERSION = "0.33.0"
NDJSON = "application/x-ndjson"
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ServerState:
    """What the routes need; `registry` is a callable so a hot reload swaps it atomically."""

    registry: Callable[[], Registry]
    manager: ModelManager
    reload: Callable[[], object] = lambda: None  # re-read the registry files now
    registry_errors: Callable[[], list[str]] = list  # why the last registry edit was not applied
    startup: Callable[[], Awaitable[None]] | None = None  # runs before the server is ready
    shutdown: Callable[[], Awaitable[None]] | None = None


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.mlxd
    return state


def lookup(state: ServerState, name: str, normalized: bool = False) -> ModelEntry:
    """The registry entry for `name`; the 404 names the model as sent (show: normalized)."""
    try:
        entry = state.registry().get(name)
        shown = parse_name(name).display if normalized else name
    except InvalidModelName as exc:
        raise ApiError(400, "invalid model name") from exc
    if entry is None:
        raise ApiError(404, f"model '{shown}' not found")
    return entry


# -- simple routes --------------------------------------------------------------------------


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def tags(request: Request) -> Response:
    state = state_of(request)
    found = await run_in_threadpool(
        lambda: [m for m in (find_local(e) for e in state.registry().entries()) if m]
    )
    found.sort(key=lambda m: m.modified_at, reverse=True)
    out: dict[str, Any] = {"models": [_with_status(state, m.entry, tag_json(m)) for m in found]}
    errors = state.registry_errors()
    if errors:  # mlxd's extra: an edit to the registry files was not applied
        out["warning"] = "serving the last good registry: " + "; ".join(errors)
    return JSONResponse(out)


def _with_status(state: ServerState, entry: ModelEntry, obj: dict[str, Any]) -> dict[str, Any]:
    """mlxd's extra: why a pairing that failed its probe is not being served."""
    probed = state.manager.probe_result(entry)
    if probed is not None and not probed.ok:
        obj.setdefault("unavailable", probed.reason)
    return obj


async def show(request: Request) -> Response:
    body = await read_json(request)
    name = field(body, "model", str) or field(body, "name", str)
    if not name:
        raise ApiError(400, "model is required")
    entry = lookup(state_of(request), name, normalized=True)
    local = await run_in_threadpool(find_local, entry)
    if local is None:
        raise ApiError(404, f"model '{entry.name}' not found")
    return JSONResponse(_with_status(state_of(request), entry, show_json(local.usable())))


# -- inference ------------------------------------------------------------------------------


def request_options(entry: ModelEntry, body: dict[str, Any]) -> SamplingOptions:
    try:
        return parse_options(entry.options, field(body, "options", dict))
    except OptionsError as exc:
        raise ApiError(400, str(exc)) from exc


def _keep_alive(body: dict[str, Any]) -> float | None:
    try:
        return parse_keep_alive(body.get("keep_alive"))
    except DurationError as exc:
        raise ApiError(400, str(exc)) from exc


THINK_LEVELS = ("low", "medium", "high", "max")


def _check_think(body: dict[str, Any], entry: ModelEntry) -> None:
    """No model served today has a thinking mode: `think: true` or a level is refused."""
    think = body.get("think")
    if think is None or think is False:
        return
    if not (think is True or think in THINK_LEVELS):
        raise ApiError(400, "invalid think value")
    raise ApiError(400, f'"{entry.name}" does not support thinking')


def check_format(body: dict[str, Any]) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt != "json" and not isinstance(fmt, dict):
        raise ApiError(
            400, f'invalid format: {json.dumps(fmt)}; expected "json" or a valid JSON Schema object'
        )
    raise ApiError(400, "structured outputs (format) are not supported by mlxd yet")


async def _acquire(
    state: ServerState, entry: ModelEntry, keep_alive: float | None
) -> tuple[Loaded, float]:
    try:
        return await state.manager.acquire(entry, keep_alive)
    except QueueFull as exc:
        raise ApiError(503, str(exc)) from exc
    except ModelUnavailable as exc:
        message = str(exc)
        if "not available locally" in message:
            raise ApiError(404, f'model "{entry.name}" not found, try pulling it first') from exc
        raise ApiError(500, message) from exc


async def _load_or_unload(
    state: ServerState,
    entry: ModelEntry,
    name: str,
    keep_alive: float | None,
    make: Callable[[str], dict[str, Any]],
) -> Response:
    """Empty prompt/messages: load the model, or with keep_alive 0 unload it."""
    if keep_alive == 0:
        state.manager.unload(entry.name)
        return JSONResponse(make("unload"))
    slot, _ = await _acquire(state, entry, keep_alive)
    state.manager.release(slot)
    return JSONResponse(make("load"))


def _render(
    pairing: Pairing, opts: SamplingOptions, tokens_before: list[int], text: str, templated: bool
) -> list[int]:
    tokens = tokens_before + encode(pairing.tokenizer, text, templated)
    if not tokens:
        raise ApiError(400, "prompt is empty after rendering")
    context = pairing.row_context(opts)
    if len(tokens) >= context:
        raise ApiError(
            400,
            f"the input length ({len(tokens)} tokens) exceeds the context length "
            f"({context} tokens)",
        )
    return tokens


def chat_renderer(
    entry: ModelEntry, messages: list[dict[str, Any]], tools: list[Any] | None
) -> Callable[[Pairing], str]:
    """How a chat request becomes a prompt for a loaded pairing (native and /v1 alike)."""

    def render(pairing: Pairing) -> str:
        if tools and "tools" not in pairing.capabilities:
            raise ApiError(400, f"{entry.name} does not support tools")
        return render_chat(pairing.tokenizer, with_system(messages, entry.system))

    return render


async def prepare(
    state: ServerState,
    entry: ModelEntry,
    keep_alive: float | None,
    render: Callable[[Pairing], str],
    opts: SamplingOptions,
    before: list[int] | None = None,
    templated: bool = True,
) -> tuple[Loaded, float, list[int]]:
    """Acquire the model, render and tokenize the prompt, which must leave room in its row's
    context; the slot is released if that fails."""
    slot, load_seconds = await _acquire(state, entry, keep_alive)
    try:
        pairing = state.manager.pairing(slot)
        text = render(pairing)
        tokens = await run_in_threadpool(_render, pairing, opts, before or [], text, templated)
    except PromptError as exc:
        state.manager.release(slot)
        msg = str(exc)
        raise ApiError(
            400, f"{entry.name} {msg}" if msg == "does not support insert" else msg
        ) from exc
    except BaseException:
        state.manager.release(slot)
        raise
    return slot, load_seconds, tokens


@dataclass
class Shape:
    """How one route wraps text and the final metrics into Ollama's objects."""

    chunk: Callable[[str], dict[str, Any]]
    final: Callable[[Done, str], dict[str, Any]]


async def respond(
    state: ServerState, slot: Loaded, gen: GenerationRequest, stream: bool, shape: Shape
) -> Response:
    manager = state.manager
    if not stream:
        parts: list[str] = []
        try:
            async for event in manager.generate(slot, gen):
                if isinstance(event, TextChunk):
                    parts.append(event.text)
                elif isinstance(event, Failed):
                    raise ApiError(500, event.message)
                elif isinstance(event, Done):
                    return JSONResponse(shape.final(event, "".join(parts)))
        finally:
            manager.release(slot)
        raise ApiError(500, "generation ended without a result")

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for event in manager.generate(slot, gen):
                if isinstance(event, TextChunk):
                    yield _line(shape.chunk(event.text))
                elif isinstance(event, Done):
                    yield _line(shape.final(event, ""))
                elif isinstance(event, Failed):
                    yield _line({"error": event.message})
        except Exception as exc:  # never a broken connection: an error line ends the stream
            log.exception("stream failed")
            yield _line({"error": str(exc) or type(exc).__name__})
        finally:
            gen.cancel.set()
            manager.release(slot)

    return StreamingResponse(lines(), media_type=NDJSON)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def _final_fields(done: Done) -> dict[str, Any]:
    return {
        "done": True,
        "done_reason": done.done_reason,
        **done.metrics.as_dict(),
        **done.speculation_fields(),
    }


async def generate(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_json(request)
    name = field(body, "model", str, "")
    if not name:
        raise ApiError(404, "model '' not found")
    entry = lookup(state, name)
    prompt = field(body, "prompt", str, "")
    suffix = field(body, "suffix", str, "")
    system = field(body, "system", str)
    template = field(body, "template", str)
    context = field(body, "context", list)
    raw = field(body, "raw", bool, False)
    stream = field(body, "stream", bool, True)
    if context is not None and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in context
    ):
        raise ApiError(400, "invalid value for field 'context': expected an array of token ids")
    if raw and (template or system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    check_format(body)
    _check_think(body, entry)
    opts = request_options(entry, body)
    keep_alive = _keep_alive(body)

    def envelope(**kw: Any) -> dict[str, Any]:
        return {"model": name, "created_at": now(), **kw}

    if not prompt and not suffix:
        return await _load_or_unload(
            state, entry, name, keep_alive,
            lambda reason: envelope(response="", done=True, done_reason=reason),
        )  # fmt: skip

    def render(pairing: Pairing) -> str:
        if context:
            _check_ids(context, pairing)
        if raw:
            return prompt
        return render_generate(
            pairing.tokenizer, prompt, system or entry.system, template, suffix, pairing.fim
        )

    slot, load_seconds, prompt_tokens = await prepare(
        state, entry, keep_alive, render, opts, list(context or []), templated=not raw
    )
    gen = GenerationRequest(prompt_tokens, opts, started=started, load_duration=load_seconds)

    def final(done: Done, text: str) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if not raw:
            extra["context"] = prompt_tokens + done.output_tokens
        return envelope(response=text, **_final_fields(done), **extra)

    shape = Shape(
        chunk=lambda text: envelope(response=text, done=False),
        final=final,
    )
    return await respond(state, slot, gen, stream, shape)


def _check_ids(ids: list[int], pairing: Pairing) -> None:
    vocab = int(pairing.config.get("vocab_size") or 0)
    if vocab and any(t < 0 or t >= vocab for t in ids):
        raise ApiError(400, "invalid value for field 'context': token id out of range")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "invalid value for field 'messages': expected an array")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ApiError(400, f"invalid message at index {i}: expected an object")
        role = msg.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise ApiError(
                400, f"invalid message at index {i}: role must be one of {', '.join(ROLES)}"
            )
        content = msg.get("content", "")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"invalid message at index {i}: content must be a string")
        if msg.get("images"):
            raise ApiError(400, "images are not supported by this model")
        clean: dict[str, Any] = {"role": role.lower(), "content": content}
        for key in ("tool_calls", "tool_name", "tool_call_id", "thinking"):
            if msg.get(key) is not None:
                clean[key] = msg[key]
        out.append(clean)
    return out


async def chat(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_json(request)
    name = field(body, "model", str, "")
    if not name:
        raise ApiError(400, "model is required")
    entry = lookup(state, name)
    messages = parse_messages(body)
    stream = field(body, "stream", bool, True)
    tools = field(body, "tools", list)
    check_format(body)
    _check_think(body, entry)
    opts = request_options(entry, body)
    keep_alive = _keep_alive(body)

    def envelope(content: str, **kw: Any) -> dict[str, Any]:
        return {
            "model": name,
            "created_at": now(),
            "message": {"role": "assistant", "content": content},
            **kw,
        }

    if not messages:
        return await _load_or_unload(
            state,
            entry,
            name,
            keep_alive,
            lambda reason: envelope("", done=True, done_reason=reason),
        )

    render = chat_renderer(entry, messages, tools)
    slot, load_seconds, prompt_tokens = await prepare(state, entry, keep_alive, render, opts)
    gen = GenerationRequest(prompt_tokens, opts, started=started, load_duration=load_seconds)
    shape = Shape(
        chunk=lambda text: envelope(text, done=False),
        final=lambda done, text: envelope(text, **_final_fields(done)),
    )
    return await respond(state, slot, gen, stream, shape)
