"""OpenAI-compatible routes under /v1, as Ollama's compatibility layer serves them.

Each route decodes its OpenAI request struct, translates it into the native building blocks
(`api.inference`: lookup, options, prompt rendering, model acquisition) and writes the engine's
events through the shared event pump as OpenAI objects: JSON for non-streaming requests,
server-sent events otherwise. Errors keep the table's status and take OpenAI's shape.
"""

from __future__ import annotations

import functools
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

from mlxd.api.chatprompt import ChatPrompt
from mlxd.api.codec import json_response, read_request, sse_event
from mlxd.api.disconnect import while_connected
from mlxd.api.errors import ApiError, log_unexpected, message_of, status_of
from mlxd.api.inference import (
    chat_head,
    native_messages,
    prepare,
    request_options,
)
from mlxd.api.logprobs import (
    TextOffsets,
    asked,
    openai_chat_json,
    openai_completion_json,
    with_logprobs,
)
from mlxd.api.modelinfo import LocalModel, find_local
from mlxd.api.pump import collect, pump
from mlxd.api.reply import Parser, Part, Plain, Reply, with_held
from mlxd.api.state import ServerState, lookup, state_of
from mlxd.api.structured import checked, from_format, from_response_format, one_of
from mlxd.api.thinking import THINKING
from mlxd.api.toolgrammar import AUTO, REQUIRED
from mlxd.api.tools import ToolCall, tool_names
from mlxd.api.types import (
    ZERO_USAGE,
    ChatChoice,
    ChatCompletionRequest,
    ChoiceMessage,
    ChunkChoice,
    Completion,
    CompletionRequest,
    Delta,
    FunctionOut,
    Message,
    ModelCard,
    ModelList,
    OpenAIError,
    OpenAIErrorDetail,
    OpenAIMessage,
    OpenAIToolCall,
    PromptTokensDetails,
    TextChoice,
    Usage,
)
from mlxd.engine.events import Done, GenerationRequest
from mlxd.engine.grammar import GrammarSpec
from mlxd.engine.logprobs import Logprob
from mlxd.engine.manager import Loaded
from mlxd.engine.pairing import Pairing
from mlxd.engine.prompt import go_template, inserts, render_generate
from mlxd.registry.names import InvalidModelName, parse_name

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
            log_unexpected(request, exc)
            status = status_of(exc)
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


def _reasoning(body: ChatCompletionRequest) -> bool | str | None:
    """`reasoning_effort` (or `reasoning.effort`) as Ollama's `think`: none turns thinking off,
    minimal is low, the levels above high are max."""
    effort = body.reasoning_effort
    if effort is None and body.reasoning is not None:
        effort = body.reasoning.effort
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise ApiError(400, "invalid reasoning value")
    mapped: dict[str, bool | str] = {
        "none": False,
        "minimal": "low",
        "xhigh": "max",
        "ultra": "max",
    }
    return mapped.get(effort, effort)


def _tool_choice(body: ChatCompletionRequest) -> tuple[list[Any] | None, str]:
    """The tools the model may call under `tool_choice`, and how: none of them for "none"; all
    of them, freely or at least one, for "auto" and "required"; only the named one, once, for
    a named function."""
    choice, tools = body.tool_choice, body.tools
    if choice is None or choice in (AUTO, REQUIRED):
        return tools, choice or AUTO
    if choice == "none":
        return None, AUTO
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "invalid tool_choice")
    if name not in tool_names(tools):  # a malformed tool: the 400 it is without a choice
        raise ApiError(400, f"tool_choice names a function that is not in tools: {name}")
    return [t for t in tools or () if t["function"]["name"] == name][:1], name


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


def _native_messages(raw: list[OpenAIMessage], model: str) -> list[dict[str, Any]]:
    """OpenAI messages as native ones (then checked as the native route checks them)."""
    out: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, for tool results that give only the id
    for msg in raw:
        role = "system" if msg.role == "developer" else msg.role
        tool_calls = _tool_calls(msg.tool_calls) if msg.tool_calls else None
        for call in tool_calls or ():
            if call.get("id") and isinstance(call["function"]["name"], str):
                names[call["id"]] = call["function"]["name"]
        is_tool = (role or "").lower() == "tool"
        tool_name = (msg.name or names.get(msg.tool_call_id or "")) if is_tool else None
        thinking = msg.reasoning or msg.reasoning_content or None
        content = msg.content
        parts = _content_parts(content) if isinstance(content, list) else [(content or "", None)]
        parts = parts or [("", None)]  # no parts: an empty message (its tool calls kept), not none
        for i, (text, images) in enumerate(parts):
            last = i == len(parts) - 1
            out.append(
                Message(
                    role=role,
                    content=text,
                    images=images,
                    tool_calls=tool_calls if last else None,
                    tool_name=tool_name if last else None,
                    tool_call_id=msg.tool_call_id if last and is_tool else None,
                    thinking=thinking if last else None,
                )
            )
    return native_messages(out, model)


# -- responses ------------------------------------------------------------------------------


def _finish_reason(done: Done, called: bool = False) -> str:
    if done.done_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def _openai_call(call: ToolCall, streamed: bool = False) -> OpenAIToolCall:
    """A call as OpenAI writes it: arguments a JSON string; in a stream, with its index."""
    args = msgspec.json.encode(call.arguments).decode()
    index = call.index if streamed else None
    return OpenAIToolCall(FunctionOut(call.name, args), call.id, "function", index)


def _choice_message(reply: Reply) -> ChoiceMessage:
    thinking = "".join(reply.thinking) or None
    content = "".join(reply.content)
    return ChoiceMessage(
        "assistant",
        None if reply.calls and not content else content,
        thinking,
        thinking,
        [_openai_call(c) for c in reply.calls] or None,
    )


def _usage(done: Done) -> Usage:
    prompt, completion = done.metrics.prompt_eval_count, done.metrics.eval_count
    cached = PromptTokensDetails(done.cached_tokens)
    return Usage(prompt, completion, prompt + completion, cached)


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
    """A /v1 stream: the reply's text goes through `parser`, each part (content, reasoning, a
    tool call) one chunk; then the finish, the usage chunk when asked for, `[DONE]`."""

    def __init__(
        self,
        env: _Envelope,
        content: Callable[[Part, bool, tuple[Logprob, ...]], Completion],  # (part, first?, lps)
        finish: Callable[[Done, bool, bool], list[Completion]],  # (done, nothing sent, called)
        usage: bool,
        parser: Parser,
    ) -> None:
        self.env = env
        self.content = content
        self.finish = finish
        self.usage = usage
        self.parser = parser
        self.first = True
        self.called = False
        self.pending: tuple[Logprob, ...] = ()  # tokens whose text the parser holds back

    def _events(self, parts: list[Part]) -> bytes:
        """A chunk per part; the tokens read since the last chunk go with the first."""
        out = []
        for part in parts:
            out.append(sse_event(self.content(part, self.first, self.pending)))
            self.pending = ()
            self.first = False
            self.called = self.called or isinstance(part, ToolCall)
        return b"".join(out)

    def text(self, text: str, logprobs: tuple[Logprob, ...] = ()) -> bytes:
        self.pending += logprobs
        return self._events(self.parser.feed(text))

    def done(self, done: Done) -> Iterable[bytes]:
        out = [self._events(with_held(self.parser.finish(), self.pending))]
        out += [sse_event(obj) for obj in self.finish(done, self.first, self.called)]
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
    messages = _native_messages(body.messages, entry.name)
    think = _reasoning(body)
    grammar = await _response_format(body)
    top = asked(body.logprobs, body.top_logprobs)
    opts = with_logprobs(request_options(entry, _sampling(body)), top)

    tools, tool_choice = _tool_choice(body)
    prompt = ChatPrompt(entry, messages, tools, think, tool_choice, answer_format=grammar)
    head = chat_head(entry, messages)
    slot, load_seconds, tokens = await while_connected(
        request,
        prepare(
            state, entry, None, prompt, opts, what="chat", head=head, grammar=lambda: prompt.grammar
        ),
    )
    gen = GenerationRequest(
        tokens, opts, started=started, load_duration=load_seconds, grammar=prompt.grammar
    )

    if not body.stream:
        env = _envelope("chatcmpl", "chat.completion", name)
        answer = await while_connected(request, collect(state.manager, slot, gen))
        reply = Reply.of(prompt.parser(), answer.text)
        finish_reason = _finish_reason(answer.done, bool(reply.calls))
        logprobs = openai_chat_json(answer.logprobs) if top is not None else None
        choice = ChatChoice(0, _choice_message(reply), finish_reason, logprobs)
        return json_response(env.wrap([choice], _usage(answer.done)))

    env = _envelope("chatcmpl", "chat.completion.chunk", name)

    def chunk(delta: Delta, finish: str | None = None, lps: Any = None) -> Completion:
        return env.wrap([ChunkChoice(0, delta, finish, lps)])

    def content(part: Part, first: bool, lps: tuple[Logprob, ...] = ()) -> Completion:
        role = "assistant" if first else None
        logprobs = openai_chat_json(lps) if lps else None
        if isinstance(part, ToolCall):
            delta = Delta(role, tool_calls=[_openai_call(part, streamed=True)])
        elif part.kind == THINKING:
            delta = Delta(role, reasoning_content=part.text, reasoning=part.text)
        else:
            delta = Delta(role, part.text)
        return chunk(delta, None, logprobs)

    def finish(done: Done, nothing_sent: bool, called: bool) -> list[Completion]:
        opening = [chunk(Delta("assistant", ""))] if nothing_sent else []
        return [*opening, chunk(Delta(), _finish_reason(done, called))]

    writer = _SseWriter(env, content, finish, _include_usage(body), prompt.parser())
    return _sse(state, slot, gen, writer)


@openai_errors
async def completions(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, CompletionRequest, state.max_body)
    name = _model_name(body.model)
    entry = lookup(state, name)
    prompt, suffix = body.prompt or "", body.suffix or ""
    usage = _include_usage(body)
    top = asked(True, body.logprobs) if body.logprobs is not None else None
    grammar = await _response_format(body)
    opts = with_logprobs(request_options(entry, _sampling(body)), top)

    def render(pairing: Pairing) -> str:
        if suffix and not inserts(pairing.fim, entry.template):
            raise ApiError(400, f"{entry.name} does not support insert")
        return render_generate(
            pairing.tokenizer, prompt, entry.system, None, suffix or None, pairing.fim,
            model_template=go_template(entry.template), seed=entry.messages,
        )  # fmt: skip

    def head(pairing: Pairing) -> str:
        return render_generate(
            pairing.tokenizer, "", entry.system, None, None, None,
            model_template=go_template(entry.template), seed=entry.messages,
        )  # fmt: skip

    slot, load_seconds, tokens = await while_connected(
        request,
        prepare(state, entry, None, render, opts, head=None if suffix else head, grammar=grammar),
    )
    gen = GenerationRequest(
        tokens, opts, started=started, load_duration=load_seconds, grammar=grammar
    )
    env = _envelope("cmpl", "text_completion", name)

    if not body.stream:
        answer = await while_connected(request, collect(state.manager, slot, gen))
        logprobs = None
        if top is not None:
            logprobs = openai_completion_json(answer.logprobs, TextOffsets(), answer.text)
        choice = TextChoice(answer.text, 0, _finish_reason(answer.done), logprobs)
        return json_response(env.wrap([choice], _usage(answer.done)))

    each = ZERO_USAGE if usage else None
    offsets = TextOffsets()  # over the whole stream

    def piece(part: Part, first: bool, lps: tuple[Logprob, ...] = ()) -> Completion:
        logprobs = openai_completion_json(lps, offsets, _text(part)) if lps else None
        return env.wrap([TextChoice(_text(part), 0, None, logprobs)], each)

    return _sse(
        state,
        slot,
        gen,
        _SseWriter(
            env,
            content=piece,
            finish=lambda done, *_: [env.wrap([TextChoice("", 0, _finish_reason(done))], each)],
            usage=usage,
            parser=Plain(),
        ),
    )


def _text(part: Part) -> str:
    return "" if isinstance(part, ToolCall) else part.text


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

    def serves(m: LocalModel) -> bool:  # OpenAI's list has no field to say why one cannot
        probed = state.manager.probe_result(m.entry)
        return m.problem is None and (probed is None or probed.ok)

    found = [m for m in found if serves(m)]
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
