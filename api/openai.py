"""OpenAI-compatible routes under /v1, as Ollama's compatibility layer serves them.

Each route translates the OpenAI request into the native building blocks of `api.ollama`
(lookup, options, prompt rendering, model acquisition) and the engine's event stream into
OpenAI objects: JSON for non-streaming requests, server-sent events otherwise. Errors keep
the native status and take OpenAI's shape.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxd.api.errors import ApiError, field, read_json
from mlxd.api.modelinfo import LocalModel, find_local
from mlxd.api.ollama import (
    ServerState,
    Shape,
    chat_renderer,
    check_format,
    lookup,
    parse_messages,
    prepare,
    request_options,
    respond,
    state_of,
)
from mlxd.engine.events import Done, Failed, GenerationRequest, TextChunk
from mlxd.engine.manager import Loaded
from mlxd.engine.pairing import Pairing
from mlxd.engine.prompt import render_generate
from mlxd.registry.names import InvalidModelName, parse_name

log = logging.getLogger(__name__)

SSE = "text/event-stream"
FINGERPRINT = "fp_ollama"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "max", "xhigh", "ultra")
_IMAGE_PREFIXES = (
    "data:;base64,",
    *(f"data:image/{kind};base64," for kind in ("jpeg", "jpg", "png", "webp")),
)

Handler = Callable[[Request], Awaitable[Response]]


# -- errors ---------------------------------------------------------------------------------


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error object; the type follows the native status."""
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def openai_errors(handler: Handler) -> Handler:
    """Answer every failure before the first byte with an OpenAI-shaped error body."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(500, str(exc) or type(exc).__name__)

    return wrapped


# -- request translation --------------------------------------------------------------------


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"invalid value for field '{name}': expected number")
    return float(value)


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        for item in stop:
            if not isinstance(item, str):
                raise ApiError(400, f"invalid type for 'stop' field: {type(item).__name__}")
        return stop
    raise ApiError(400, "invalid value for field 'stop': expected string or array of strings")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sampling fields as native options; temperature and top_p default to 1.0."""
    options: dict[str, Any] = {}
    stop = _stop(body)
    if stop is not None:
        options["stop"] = stop
    max_tokens = field(body, "max_tokens", int)
    if max_tokens is None:  # newer SDKs send this name instead
        max_tokens = field(body, "max_completion_tokens", int)
    if max_tokens is not None:
        options["num_predict"] = max_tokens
    seed = field(body, "seed", int)
    if seed is not None:
        options["seed"] = seed
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name)
        if value is not None:
            options[name] = value
    temperature = _number(body, "temperature")
    options["temperature"] = 1.0 if temperature is None else temperature
    top_p = _number(body, "top_p")
    options["top_p"] = top_p or 1.0  # 0 counts as unset
    return options


def _include_usage(body: dict[str, Any]) -> bool:
    stream_options = field(body, "stream_options", dict, {})
    return bool(field(stream_options, "include_usage", bool, False))


def _response_format(body: dict[str, Any]) -> None:
    """Only plain text is supported; JSON modes get the native route's 400."""
    fmt = field(body, "response_format", dict)
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        check_format({"format": "json"})
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        check_format({"format": schema if isinstance(schema, dict) else {}})
    raise ApiError(400, f"invalid response_format type: {json.dumps(kind)}")


def _reasoning(body: dict[str, Any]) -> None:
    """Validated like Ollama; the engine has no thinking mode, so the value is not used."""
    effort = body.get("reasoning_effort")
    if effort is None:
        effort = field(body, "reasoning", dict, {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(400, "invalid reasoning value")


def _image(part: dict[str, Any]) -> str:
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise ApiError(400, "invalid message format")
    for prefix in _IMAGE_PREFIXES:
        if url.startswith(prefix):
            return url[len(prefix) :]
    if url.startswith(("http://", "https://")):
        raise ApiError(
            400, "image URLs are not currently supported, please use base64 encoded data instead"
        )
    raise ApiError(400, "invalid image input")


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Assistant tool calls with their JSON-string arguments parsed to objects."""
    if not isinstance(calls, list):
        raise ApiError(400, "invalid message format")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ApiError(400, "invalid message format")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise ApiError(400, "invalid tool call arguments") from exc
        native: dict[str, Any] = {"function": {"name": fn.get("name"), "arguments": args or {}}}
        if call.get("id"):
            native["id"] = call["id"]
        out.append(native)
    return out


def _native_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages as native ones (then validated by the native route's own check)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise ApiError(400, f"invalid message at index {i}: expected an object")
        role = msg.get("role")
        if role == "developer":
            role = "system"
        extra: dict[str, Any] = {}
        if msg.get("tool_calls"):
            extra["tool_calls"] = _tool_calls(msg["tool_calls"])
        if isinstance(role, str) and role.lower() == "tool":
            tool_name = msg.get("name") or msg.get("tool_call_id")
            if tool_name:
                extra["tool_name"] = tool_name
        if msg.get("reasoning"):
            extra["thinking"] = msg["reasoning"]
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": role, "content": content or "", **extra})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"invalid message content type: {type(content).__name__}")
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"role": role, "content": part["text"]})
            elif kind == "image_url":
                parts.append({"role": role, "content": "", "images": [_image(part)]})
            elif kind == "input_audio":
                raise ApiError(400, "audio input is not supported by this model")
            else:
                raise ApiError(400, "invalid message format")
        if parts:
            parts[-1].update(extra)
        out.extend(parts)
    return parse_messages({"messages": out})


# -- responses ------------------------------------------------------------------------------


def _finish_reason(done: Done) -> str:
    return "length" if done.done_reason == "length" else "stop"


def _usage(done: Done) -> dict[str, int]:
    prompt = done.metrics.prompt_eval_count
    completion = done.metrics.eval_count
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


_ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@dataclass
class _Envelope:
    """The fields every object of one response shares."""

    id: str
    object: str
    model: str
    created: int

    def wrap(self, **kw: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            **kw,
        }


def _envelope(prefix: str, kind: str, model: str) -> _Envelope:
    return _Envelope(f"{prefix}-{random.randrange(999)}", kind, model, int(time.time()))


@dataclass
class _Stream:
    """How one route writes content, the finish and the usage as stream chunks."""

    content: Callable[[str, bool], dict[str, Any]]  # (text, first chunk?)
    finish: Callable[[Done, bool], list[dict[str, Any]]]  # (done, nothing sent yet?)
    usage: Callable[[Done], dict[str, Any]]


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def _sse(
    state: ServerState, slot: Loaded, gen: GenerationRequest, stream: _Stream, usage: bool
) -> StreamingResponse:
    manager = state.manager

    async def events() -> AsyncIterator[bytes]:
        first, finished = True, False
        try:
            async for event in manager.generate(slot, gen):
                if isinstance(event, TextChunk) and event.text:
                    yield _event(stream.content(event.text, first))
                    first = False
                elif isinstance(event, Done):
                    for obj in stream.finish(event, first):
                        yield _event(obj)
                    if usage:
                        yield _event(stream.usage(event))
                    yield b"data: [DONE]\n\n"
                    finished = True
                elif isinstance(event, Failed):
                    yield _event(error_body(500, event.message))
                    finished = True
            if not finished:
                yield _event(error_body(500, "generation ended without a result"))
        except Exception as exc:  # never a broken connection: an error event ends the stream
            log.exception("stream failed")
            yield _event(error_body(500, str(exc) or type(exc).__name__))
        finally:
            gen.cancel.set()
            manager.release(slot)

    return StreamingResponse(events(), media_type=SSE, headers={"Cache-Control": "no-cache"})


# -- routes ---------------------------------------------------------------------------------


def _model_name(body: dict[str, Any]) -> str:
    name = field(body, "model", str, "")
    if not name:
        raise ApiError(400, "model is required")
    return str(name)


@openai_errors
async def chat_completions(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_json(request)
    raw = body.get("messages")
    if raw is not None and not isinstance(raw, list):
        raise ApiError(400, "invalid value for field 'messages': expected an array")
    if not raw:
        raise ApiError(400, "[] is too short - 'messages'")
    name = _model_name(body)
    entry = lookup(state, name)
    messages = _native_messages(raw)
    stream = field(body, "stream", bool, False)
    usage = _include_usage(body)
    tools = field(body, "tools", list)
    _reasoning(body)
    _response_format(body)
    opts = request_options(entry, {"options": _sampling(body)})

    render = chat_renderer(entry, messages, tools)
    slot, load_seconds, tokens = await prepare(state, entry, None, render, opts)
    gen = GenerationRequest(tokens, opts, started=started, load_duration=load_seconds)

    if not stream:
        env = _envelope("chatcmpl", "chat.completion", name)

        def final(done: Done, text: str) -> dict[str, Any]:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": _finish_reason(done)}
            return env.wrap(choices=[choice], usage=_usage(done))

        return await respond(state, slot, gen, False, Shape(chunk=lambda text: {}, final=final))

    env = _envelope("chatcmpl", "chat.completion.chunk", name)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return env.wrap(choices=[{"index": 0, "delta": delta, "finish_reason": finish}])

    def content(text: str, first: bool) -> dict[str, Any]:
        return chunk({"role": "assistant", "content": text} if first else {"content": text})

    def finish(done: Done, nothing_sent: bool) -> list[dict[str, Any]]:
        opening = [content("", True)] if nothing_sent else []
        return [*opening, chunk({}, _finish_reason(done))]

    return _sse(
        state,
        slot,
        gen,
        _Stream(content, finish, lambda done: env.wrap(choices=[], usage=_usage(done))),
        usage,
    )


@openai_errors
async def completions(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_json(request)
    name = _model_name(body)
    entry = lookup(state, name)
    prompt = field(body, "prompt", str, "")
    suffix = field(body, "suffix", str, "")
    stream = field(body, "stream", bool, False)
    usage = _include_usage(body)
    opts = request_options(entry, {"options": _sampling(body)})

    def render(pairing: Pairing) -> str:
        return render_generate(
            pairing.tokenizer, prompt, entry.system, None, suffix or None, pairing.fim
        )

    slot, load_seconds, tokens = await prepare(state, entry, None, render, opts)
    gen = GenerationRequest(tokens, opts, started=started, load_duration=load_seconds)
    env = _envelope("cmpl", "text_completion", name)

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "finish_reason": finish}

    if not stream:

        def final(done: Done, text: str) -> dict[str, Any]:
            return env.wrap(choices=[choice(text, _finish_reason(done))], usage=_usage(done))

        return await respond(state, slot, gen, False, Shape(chunk=lambda text: {}, final=final))

    extra: dict[str, Any] = {"usage": dict(_ZERO_USAGE)} if usage else {}
    return _sse(
        state,
        slot,
        gen,
        _Stream(
            content=lambda text, first: env.wrap(choices=[choice(text, None)], **extra),
            finish=lambda done, _: [env.wrap(choices=[choice("", _finish_reason(done))], **extra)],
            usage=lambda done: env.wrap(choices=[], usage=_usage(done)),
        ),
        usage,
    )


def _model_json(local: LocalModel, model_id: str) -> dict[str, Any]:
    try:
        owner = parse_name(model_id).namespace
    except InvalidModelName:
        owner = parse_name(local.entry.name).namespace
    return {
        "id": model_id,
        "object": "model",
        "created": int(local.modified_at.timestamp()),
        "owned_by": owner,
    }


@openai_errors
async def list_models(request: Request) -> Response:
    state = state_of(request)
    found = await run_in_threadpool(
        lambda: [m for m in (find_local(e) for e in state.registry().entries()) if m]
    )
    found = [m for m in found if m.problem is None]  # OpenAI's list has no field to say why
    found.sort(key=lambda m: m.modified_at, reverse=True)
    return JSONResponse({"object": "list", "data": [_model_json(m, m.entry.name) for m in found]})


@openai_errors
async def retrieve_model(request: Request) -> Response:
    name = str(request.path_params["model"])
    if not name:
        raise ApiError(404, "model '' not found")
    entry = lookup(state_of(request), name)
    local = await run_in_threadpool(find_local, entry)
    if local is None:
        raise ApiError(404, f"model '{name}' not found")
    return JSONResponse(_model_json(local.usable(), name))


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
