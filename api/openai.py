"""OpenAI-compatible routes under /v1, as Ollama's compatibility layer serves them.

Each route decodes its OpenAI request struct, translates it into the native building blocks
(`api.inference`: lookup, options, prompt rendering, model acquisition) and writes the engine's
events through the shared event pump as OpenAI objects: JSON for non-streaming requests,
server-sent events otherwise. Errors keep the table's status and take OpenAI's shape.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mlxd.api.codec import json_response, read_request, sse_event
from mlxd.api.errors import ApiError, message_of, status_of
from mlxd.api.inference import (
    chat_renderer,
    native_messages,
    prepare,
    request_options,
)
from mlxd.api.modelinfo import LocalModel, find_local
from mlxd.api.pump import collect, pump
from mlxd.api.state import ServerState, lookup, state_of
from mlxd.api.structured import checked, from_format, from_response_format, one_of
from mlxd.api.types import (
    ZERO_USAGE,
    ChatChoice,
    ChatCompletionRequest,
    ChoiceMessage,
    ChunkChoice,
    Completion,
    CompletionRequest,
    Delta,
    Message,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorDetail,
    OpenAIMessage,
    TextChoice,
    Usage,
)
from mlxd.engine.events import Done, GenerationRequest
from mlxd.engine.grammar import GrammarSpec
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


def error_body(status: int, message: str) -> OpenAIError:
    """OpenAI's error object; the type follows the status."""
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return OpenAIError(OpenAIErrorDetail(message, kind, None, None))


def openai_errors(handler: Handler) -> Handler:
    """Answer every failure before the first byte with an OpenAI-shaped error body."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            status = status_of(exc)
            if status >= 500:
                log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
            return json_response(error_body(status, message_of(exc)), status)

    return wrapped


# -- request translation --------------------------------------------------------------------


def _stop(stop: str | list[Any] | None) -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    for item in stop:
        if not isinstance(item, str):
            raise ApiError(400, f"invalid type for 'stop' field: {type(item).__name__}")
    return stop


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """OpenAI sampling fields as native options; temperature and top_p default to 1.0."""
    options: dict[str, Any] = {}
    stop = _stop(body.stop)
    if stop is not None:
        options["stop"] = stop
    max_tokens = body.max_tokens
    if max_tokens is None and isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        options["num_predict"] = max_tokens
    if body.seed is not None:
        options["seed"] = body.seed
    if body.frequency_penalty is not None:
        options["frequency_penalty"] = body.frequency_penalty
    if body.presence_penalty is not None:
        options["presence_penalty"] = body.presence_penalty
    options["temperature"] = 1.0 if body.temperature is None else body.temperature
    options["top_p"] = body.top_p or 1.0  # 0 counts as unset
    return options


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _response_format(body: ChatCompletionRequest | CompletionRequest) -> GrammarSpec | None:
    """`response_format` (or, as on the native routes, `format`: not both) as a grammar."""
    spec = one_of(from_response_format(body.response_format), from_format(body.format))
    return await checked(spec)


def _reasoning(body: ChatCompletionRequest) -> None:
    """Validated like Ollama; the engine has no thinking mode, so the value is not used."""
    effort = body.reasoning_effort
    if effort is None and body.reasoning is not None:
        effort = body.reasoning.effort
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


def _arguments(args: Any) -> Any:
    """A tool call's arguments: OpenAI sends a JSON string, the chat template wants an object."""
    if not isinstance(args, str):
        return args or {}
    if not args.strip():
        return {}
    try:
        return msgspec.json.decode(args)
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        raise ApiError(400, "invalid tool call arguments") from exc


def _tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Assistant tool calls in the native shape, their arguments parsed."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ApiError(400, "invalid message format")
        native: dict[str, Any] = {
            "function": {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}
        }
        if call.get("id"):
            native["id"] = call["id"]
        out.append(native)
    return out


def _content_parts(content: list[Any]) -> list[tuple[str, list[str] | None]]:
    """(text, images) per content part."""
    parts: list[tuple[str, list[str] | None]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append((part["text"], None))
        elif kind == "image_url":
            parts.append(("", [_image(part)]))
        elif kind == "input_audio":
            raise ApiError(400, "audio input is not supported by this model")
        else:
            raise ApiError(400, "invalid message format")
    return parts


def _native_messages(raw: list[OpenAIMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as native ones (then checked as the native route checks them)."""
    out: list[Message] = []
    for msg in raw:
        role = "system" if msg.role == "developer" else msg.role
        tool_calls = _tool_calls(msg.tool_calls) if msg.tool_calls else None
        tool_name = (msg.name or msg.tool_call_id) if (role or "").lower() == "tool" else None
        thinking = msg.reasoning or None
        content = msg.content
        parts = _content_parts(content) if isinstance(content, list) else [(content or "", None)]
        for i, (text, images) in enumerate(parts):
            last = i == len(parts) - 1
            out.append(
                Message(
                    role=role,
                    content=text,
                    images=images,
                    tool_calls=tool_calls if last else None,
                    tool_name=tool_name if last else None,
                    thinking=thinking if last else None,
                )
            )
    return native_messages(out)


# -- responses ------------------------------------------------------------------------------


def _finish_reason(done: Done) -> str:
    return "length" if done.done_reason == "length" else "stop"


def _usage(done: Done) -> Usage:
    prompt, completion = done.metrics.prompt_eval_count, done.metrics.eval_count
    return Usage(prompt, completion, prompt + completion)


@dataclass(frozen=True)
class _Envelope:
    """The fields every object of one response shares."""

    id: str
    object: str
    model: str
    created: int

    def wrap(self, choices: list[Any], usage: Usage | None = None) -> Completion:
        return Completion(
            self.id, self.object, self.created, self.model, FINGERPRINT, choices, usage
        )


def _envelope(prefix: str, kind: str, model: str) -> _Envelope:
    return _Envelope(f"{prefix}-{random.randrange(999)}", kind, model, int(time.time()))


class _SseWriter:
    """A /v1 stream: content chunks, the finish, the usage chunk when asked for, `[DONE]`."""

    def __init__(
        self,
        env: _Envelope,
        content: Callable[[str, bool], Completion],  # (text, first chunk?)
        finish: Callable[[Done, bool], list[Completion]],  # (done, nothing sent yet?)
        usage: bool,
    ) -> None:
        self.env = env
        self.content = content
        self.finish = finish
        self.usage = usage
        self.first = True

    def text(self, text: str) -> bytes:
        piece = sse_event(self.content(text, self.first))
        self.first = False
        return piece

    def done(self, done: Done) -> Iterable[bytes]:
        out = [sse_event(obj) for obj in self.finish(done, self.first)]
        if self.usage:
            out.append(sse_event(self.env.wrap([], _usage(done))))
        out.append(b"data: [DONE]\n\n")
        return out

    def failed(self, message: str) -> bytes:
        return sse_event(error_body(500, message))


def _sse(state: ServerState, slot: Loaded, gen: GenerationRequest, writer: _SseWriter) -> Response:
    return StreamingResponse(
        pump(state.manager, slot, gen, writer),
        media_type=SSE,
        headers={"Cache-Control": "no-cache"},
    )


# -- routes ---------------------------------------------------------------------------------


def _model_name(name: str | None) -> str:
    if not name:
        raise ApiError(400, "model is required")
    return name


@openai_errors
async def chat_completions(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, ChatCompletionRequest, state.max_body)
    if not body.messages:
        raise ApiError(400, "[] is too short - 'messages'")
    name = _model_name(body.model)
    entry = lookup(state, name)
    messages = _native_messages(body.messages)
    _reasoning(body)
    grammar = await _response_format(body)
    opts = request_options(entry, _sampling(body))

    render = chat_renderer(entry, messages, body.tools)
    slot, load_seconds, tokens = await prepare(state, entry, None, render, opts, grammar=grammar)
    gen = GenerationRequest(
        tokens, opts, started=started, load_duration=load_seconds, grammar=grammar
    )

    if not body.stream:
        env = _envelope("chatcmpl", "chat.completion", name)
        answer = await collect(state.manager, slot, gen)
        message = ChoiceMessage("assistant", answer.text)
        choice = ChatChoice(0, message, _finish_reason(answer.done))
        return json_response(env.wrap([choice], _usage(answer.done)))

    env = _envelope("chatcmpl", "chat.completion.chunk", name)

    def chunk(delta: Delta, finish: str | None = None) -> Completion:
        return env.wrap([ChunkChoice(0, delta, finish)])

    def content(text: str, first: bool) -> Completion:
        return chunk(Delta("assistant", text) if first else Delta(content=text))

    def finish(done: Done, nothing_sent: bool) -> list[Completion]:
        opening = [content("", True)] if nothing_sent else []
        return [*opening, chunk(Delta(), _finish_reason(done))]

    return _sse(state, slot, gen, _SseWriter(env, content, finish, _include_usage(body)))


@openai_errors
async def completions(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, CompletionRequest, state.max_body)
    name = _model_name(body.model)
    entry = lookup(state, name)
    prompt, suffix = body.prompt or "", body.suffix or ""
    usage = _include_usage(body)
    grammar = await _response_format(body)
    opts = request_options(entry, _sampling(body))

    def render(pairing: Pairing) -> str:
        if suffix and pairing.fim is None:
            raise ApiError(400, f"{entry.name} does not support insert")
        return render_generate(
            pairing.tokenizer, prompt, entry.system, None, suffix or None, pairing.fim
        )

    slot, load_seconds, tokens = await prepare(state, entry, None, render, opts, grammar=grammar)
    gen = GenerationRequest(
        tokens, opts, started=started, load_duration=load_seconds, grammar=grammar
    )
    env = _envelope("cmpl", "text_completion", name)

    if not body.stream:
        answer = await collect(state.manager, slot, gen)
        choice = TextChoice(answer.text, 0, _finish_reason(answer.done))
        return json_response(env.wrap([choice], _usage(answer.done)))

    each = ZERO_USAGE if usage else None
    return _sse(
        state,
        slot,
        gen,
        _SseWriter(
            env,
            content=lambda text, first: env.wrap([TextChoice(text, 0, None)], each),
            finish=lambda done, _: [env.wrap([TextChoice("", 0, _finish_reason(done))], each)],
            usage=usage,
        ),
    )


def _model_card(local: LocalModel, model_id: str) -> ModelCard:
    try:
        owner = parse_name(model_id).namespace
    except InvalidModelName:
        owner = parse_name(local.entry.name).namespace
    return ModelCard(model_id, "model", int(local.modified_at.timestamp()), owner)


@openai_errors
async def list_models(request: Request) -> Response:
    state = state_of(request)
    found = await run_in_threadpool(
        lambda: [m for m in (find_local(e) for e in state.registry().entries()) if m]
    )
    found = [m for m in found if m.problem is None]  # OpenAI's list has no field to say why
    found.sort(key=lambda m: m.modified_at, reverse=True)
    return json_response(ModelList("list", [_model_card(m, m.entry.name) for m in found]))


@openai_errors
async def retrieve_model(request: Request) -> Response:
    name = str(request.path_params["model"])
    if not name:
        raise ApiError(404, "model '' not found")
    entry = lookup(state_of(request), name)
    local = await run_in_threadpool(find_local, entry)
    if local is None:
        raise ApiError(404, f"model '{name}' not found")
    return json_response(_model_card(local.usable(), name))


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
