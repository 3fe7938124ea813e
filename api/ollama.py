"""Ollama's native routes: version, tags, show, generate and chat."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from mlxd.api.chatformat import model_format, opens_thinking
from mlxd.api.chatprompt import ChatPrompt, check_think_value, resolve_think, template_kwargs
from mlxd.api.codec import NDJSON, json_response, ndjson_line, read_request
from mlxd.api.disconnect import while_connected
from mlxd.api.durations import parse_keep_alive
from mlxd.api.errors import ApiError
from mlxd.api.inference import (
    chat_head,
    check_images,
    native_messages,
    prepare,
    request_options,
    with_pairing,
)
from mlxd.api.logprobs import asked, ollama_json, with_logprobs
from mlxd.api.modelinfo import find_local, show_json, tag_json
from mlxd.api.pump import collect, pump
from mlxd.api.reply import Parser, Part, Plain, Reply, reply_parser, with_held
from mlxd.api.state import NOT_FOUND, ServerState, lookup, state_of
from mlxd.api.structured import request_grammar
from mlxd.api.thinking import THINKING
from mlxd.api.toolgrammar import after_thinking
from mlxd.api.tools import ToolCall
from mlxd.api.types import (
    ChatRequest,
    ChatResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ModelRequest,
    ResponseMessage,
    TagsResponse,
    ToolCallFunction,
    ToolCallOut,
    VersionResponse,
)
from mlxd.engine.events import Done, GenerationRequest
from mlxd.engine.logprobs import Logprob
from mlxd.engine.pairing import Pairing
from mlxd.engine.prompt import go_template, inserts, render_generate
from mlxd.registry.schema import ModelEntry

VERSION = "0.33.0"


def now() -> datetime:
    return datetime.now(timezone.utc)


# -- simple routes --------------------------------------------------------------------------


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    return json_response(VersionResponse(VERSION))


async def tags(request: Request) -> Response:
    state = state_of(request)
    found = await run_in_threadpool(
        lambda: [m for m in (find_local(e) for e in state.registry().entries()) if m]
    )
    found.sort(key=lambda m: m.modified_at, reverse=True)
    errors = state.registry_errors()
    warning = "serving the last good registry: " + "; ".join(errors) if errors else None
    summaries = [tag_json(m, _unavailable(state, m.entry)) for m in found]
    for summary, m in zip(summaries, found, strict=True):
        if state.manager.probe_pending(m.entry):
            summary.status = "probing"
    return json_response(TagsResponse(summaries, warning))


def _unavailable(state: ServerState, entry: ModelEntry) -> str | None:
    """mlxd's extra: why a pairing that failed its probe is not being served."""
    probed = state.manager.probe_result(entry)
    return probed.reason if probed is not None and not probed.ok else None


async def show(request: Request) -> Response:
    state = state_of(request)
    body = await read_request(request, ModelRequest, state.max_body)
    name = body.model or body.name or ""
    entry = lookup(state, name, normalized=True)
    local = await run_in_threadpool(find_local, entry)
    if local is None:
        raise ApiError(404, f"model '{entry.name}' not found")
    shown = await run_in_threadpool(
        show_json, local.usable(), _unavailable(state, entry), bool(body.verbose)
    )
    return json_response(shown)


# -- the final object -----------------------------------------------------------------------


def final_fields(done: Done) -> dict[str, Any]:
    """Ollama's metrics and mlxd's extras for a final object, from the engine's values."""
    m, s = done.metrics, done.speculation
    out: dict[str, Any] = {
        "done_reason": done.done_reason,
        "total_duration": m.total_duration,
        "load_duration": m.load_duration,
        "prompt_eval_count": m.prompt_eval_count,
        "prompt_eval_duration": m.prompt_eval_duration,
        "eval_count": m.eval_count,
        "eval_duration": m.eval_duration,
        "prompt_cache_tokens": done.cached_tokens,
        "draft_method": s.method,
        "draft_fallback_reason": s.fallback_reason or None,
        "draft_disabled_reason": s.disabled_reason or None,
    }
    if s.method != "off":
        out.update(
            draft_count=s.drafted,
            draft_accepted=s.accepted,
            draft_acceptance_rate=round(s.acceptance_rate, 4),
            draft_tokens_per_round=round(s.tokens_per_round, 4),
            draft_acceptance_by_position=s.acceptance_by_position(),
            draft_filled=s.filled,
            draft_filled_accepted=s.filled_accepted,
        )
    return out


@dataclass(frozen=True)
class NdjsonWriter:
    """A /api stream: the reply's text goes through `parser`; `chunk` makes a partial object of
    each part (content, thinking or a tool call), `final` the last one."""

    chunk: Callable[[Part, list[dict[str, Any]] | None], Any]  # a part, its tokens' logprobs
    final: Callable[[Done], Any]
    parser: Parser
    pending: list[Logprob] = field(default_factory=list)  # tokens whose text is held back

    def _lines(self, parts: list[Part]) -> bytes:
        """The parts' objects; the tokens read since the last one go with the first."""
        lines = []
        for part in parts:
            lines.append(ndjson_line(self.chunk(part, ollama_json(self.pending))))
            self.pending.clear()
        return b"".join(lines)

    def text(self, text: str, logprobs: tuple[Logprob, ...] = ()) -> bytes:
        self.pending.extend(logprobs)
        return self._lines(self.parser.feed(text))

    def done(self, done: Done) -> Iterable[bytes]:
        return (
            self._lines(with_held(self.parser.finish(), self.pending)),
            ndjson_line(self.final(done)),
        )

    def failed(self, message: str) -> bytes:
        return ndjson_line(ErrorResponse(message))


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(call.id, ToolCallFunction(call.index, call.name, call.arguments))


def chat_message(parts: Reply) -> ResponseMessage:
    """A reply's parts as one assistant message; empty thinking and calls are left out."""
    return ResponseMessage(
        "assistant",
        "".join(parts.content),
        "".join(parts.thinking) or None,
        [tool_call_out(c) for c in parts.calls] or None,
    )


async def _load_or_unload(
    state: ServerState,
    entry: ModelEntry,
    keep: float | None,
    make: Callable[[str], Any],
    what: str = "generate",
) -> Response:
    """Empty prompt/messages: load the model, or with keep_alive 0 unload it. An embedding
    model is loaded and then refused (400), as Ollama checks the capability first."""
    if keep == 0:
        state.manager.unload(entry.name)
        return json_response(make("unload"))
    await with_pairing(state, entry, keep, lambda pairing: None, what)
    return json_response(make("load"))


def _continued(done: Done, tokenizer: Any) -> list[int]:
    """The output as `context` carries it: its tokens, or where a stop string cut the text
    short of them, the text sent (as Ollama's `context` is: a client continues from what it
    read, not from the stop it never saw): the tokens whose text it holds whole, then the
    rest of a token the stop cut, read in its place (`_tail`): tokenizing it alone, or the
    whole reply, gives a SentencePiece tokenizer's `▁` where the model wrote no space."""
    out, text = done.output_tokens, done.stopped_text
    if text is None:
        return out
    lo, hi = 0, len(out)  # the most tokens whose text the sent text starts with
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(tokenizer.decode(out[:mid])):
            lo = mid
        else:
            hi = mid - 1
    rest = text[len(tokenizer.decode(out[:lo])) :]
    return out[:lo] + (_tail(rest, tokenizer) if rest else [])


def _tail(rest: str, tokenizer: Any) -> list[int]:
    """Tokens of text that continues other text: read after an anchor and split off from it,
    so a SentencePiece tokenizer gives it no `▁` of its own (where the split does not give
    the text back, its own tokens)."""
    anchor = "\n"
    head = list(tokenizer.encode(anchor, add_special_tokens=False))
    both = list(tokenizer.encode(anchor + rest, add_special_tokens=False))
    if both[: len(head)] == head and tokenizer.decode(both[len(head) :]) == rest:
        return both[len(head) :]
    return list(tokenizer.encode(rest, add_special_tokens=False))


def _rendered(name: str, text: str, images: int, **reply: Any) -> Response:
    """Ollama's answer to `_debug_render_only`: the rendered prompt, the model not run."""
    debug = {"rendered_template": str(text), "image_count": images}
    body = {"model": name, "created_at": now(), **reply, "done": False, "_debug_info": debug}
    return json_response(body)


# -- generate -------------------------------------------------------------------------------


async def generate(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, GenerateRequest, state.max_body)
    name = body.model or ""
    if not name:
        raise ApiError(404, "model '' not found")
    # a name that cannot be one is not found, as Ollama's generate answers it
    entry = lookup(state, name, invalid=ApiError(404, NOT_FOUND.format(name)))
    prompt, suffix, context = body.prompt or "", body.suffix or "", body.context
    raw = bool(body.raw)
    if raw and (body.template or body.system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    grammar = await request_grammar(body.format, body.options)
    check_think_value(body.think)
    check_images(body.images, entry.name)
    opts = with_logprobs(
        request_options(entry, body.options), asked(body.logprobs, body.top_logprobs)
    )
    keep = parse_keep_alive(body.keep_alive)  # DurationError: 400

    if not prompt and not suffix:
        return await _load_or_unload(
            state, entry, keep,
            lambda reason: GenerateResponse(name, now(), "", True, done_reason=reason),
        )  # fmt: skip

    # how the reply is split (thinking), and so where `format` starts to hold: known once
    # `render` has seen the model's template
    parsers: list[Callable[[], Parser]] = [Plain]
    grammars = [grammar]
    tokenizers: list[Any] = [None]

    seed = () if context else entry.messages  # the model's MESSAGE lines open a conversation

    def render(pairing: Pairing) -> str:
        tokenizers[0] = pairing.tokenizer
        if context:
            _check_ids(context, pairing)
        fmt = model_format(entry.template, pairing.tokenizer)
        think = resolve_think(body.think, fmt, entry.name)
        if suffix and not inserts(pairing.fim, entry.template):  # `raw` too, as Ollama checks
            raise ApiError(400, f"{entry.name} does not support insert")
        if raw:
            text = prompt
        else:
            system = body.system or entry.system
            text = render_generate(
                pairing.tokenizer, prompt, system, body.template, suffix, pairing.fim,
                template_kwargs(fmt, think), go_template(entry.template), seed,
            )  # fmt: skip
        # the model's own tags split its thinking; a prompt it did not render (`raw`, a
        # request's template) only where `think` asks for it, as Ollama does
        if not suffix and (bool(body.think) or not (raw or body.template)):
            parsers[0] = lambda: reply_parser(fmt, text, think.on, None)
            if grammar is not None and fmt.think is not None:
                inside = opens_thinking(text, fmt.think)
                grammars[0] = after_thinking(grammar, fmt, pairing.tokenizer, think.on, inside)
        return text

    def head(pairing: Pairing) -> str:  # what truncation keeps first: all but the prompt
        system = body.system or entry.system
        return render_generate(
            pairing.tokenizer, "", system, body.template, None, None,
            model_template=go_template(entry.template), seed=seed,
        )  # fmt: skip

    if body.debug_render_only:
        text = await with_pairing(state, entry, keep, lambda p: _after_context(p, context, render))
        return _rendered(name, text, len(body.images or []), response="")

    slot, load_seconds, prompt_tokens = await while_connected(request, prepare(
        state, entry, keep, render, opts, list(context or []), templated=not raw,
        head=None if raw or suffix else head, grammar=lambda: grammars[0],
        truncate=body.truncate is not False,
    ))  # fmt: skip
    gen = GenerationRequest(
        prompt_tokens, opts, started=started, load_duration=load_seconds, grammar=grammars[0]
    )

    def final(done: Done, reply: Reply | None = None, logprobs: Any = None) -> GenerateResponse:
        tokens = None if raw else prompt_tokens + _continued(done, tokenizers[0])
        text = "".join(reply.content) if reply else ""
        thinking = ("".join(reply.thinking) or None) if reply else None
        return GenerateResponse(
            name,
            now(),
            text,
            True,
            thinking,
            logprobs=logprobs,
            context=tokens,
            **final_fields(done),
        )

    if body.stream is False:
        answer = await while_connected(request, collect(state.manager, slot, gen))
        reply = Reply.of(parsers[0](), answer.text)
        return json_response(final(answer.done, reply, ollama_json(answer.logprobs)))

    def chunk(part: Part, lp: list[dict[str, Any]] | None) -> GenerateResponse:
        if isinstance(part, ToolCall):  # generate declares no tools: never produced
            return GenerateResponse(name, now(), "", False, logprobs=lp)
        if part.kind == THINKING:
            return GenerateResponse(name, now(), "", False, part.text, logprobs=lp)
        return GenerateResponse(name, now(), part.text, False, logprobs=lp)

    writer = NdjsonWriter(chunk, final, parsers[0]())
    return StreamingResponse(pump(state.manager, slot, gen, writer), media_type=NDJSON)


def _after_context(
    pairing: Pairing, context: list[int] | None, render: Callable[[Pairing], str]
) -> str:
    """The prompt as the model reads it: a `context` sent back (its text, as Ollama writes it
    before the template), then the rendering."""
    text = render(pairing)  # checks the context's ids
    return pairing.tokenizer.decode(list(context)) + text if context else text


def _check_ids(ids: list[int], pairing: Pairing) -> None:
    vocab = int(pairing.config.get("vocab_size") or 0)
    if vocab and any(t < 0 or t >= vocab for t in ids):
        raise ApiError(400, "invalid value for field 'context': token id out of range")


# -- chat -----------------------------------------------------------------------------------


async def chat(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, ChatRequest, state.max_body)
    name = body.model or ""
    # a name that cannot be one is no model, as Ollama's chat answers it
    entry = lookup(state, name, invalid=ApiError(400, "model is required"))
    messages = native_messages(body.messages or [], entry.name)
    grammar = await request_grammar(body.format, body.options)
    opts = with_logprobs(
        request_options(entry, body.options), asked(body.logprobs, body.top_logprobs)
    )
    keep = parse_keep_alive(body.keep_alive)  # DurationError: 400
    prompt = ChatPrompt(entry, messages, body.tools, body.think, answer_format=grammar)

    def answer(message: ResponseMessage, done: bool, **extra: Any) -> ChatResponse:
        return ChatResponse(name, now(), message, done, **extra)

    def empty() -> ResponseMessage:
        return ResponseMessage("assistant", "")

    if not messages:
        return await _load_or_unload(
            state, entry, keep, lambda reason: answer(empty(), True, done_reason=reason), "chat"
        )

    if body.debug_render_only:
        text = await with_pairing(state, entry, keep, prompt, "chat")
        images = sum(len(m.images or []) for m in body.messages or [])
        return _rendered(name, text, images, message={"role": "", "content": ""})

    head = chat_head(entry, messages)
    preparing = prepare(
        state, entry, keep, prompt, opts, what="chat", head=head,
        grammar=lambda: prompt.grammar, truncate=body.truncate is not False,
    )  # fmt: skip
    slot, load_seconds, prompt_tokens = await while_connected(request, preparing)
    gen = GenerationRequest(
        prompt_tokens, opts, started=started, load_duration=load_seconds, grammar=prompt.grammar
    )
    if body.stream is False:
        whole = await while_connected(request, collect(state.manager, slot, gen))
        reply = Reply.of(prompt.parser(), whole.text)
        logprobs = ollama_json(whole.logprobs)
        return json_response(
            answer(chat_message(reply), True, logprobs=logprobs, **final_fields(whole.done))
        )

    def chunk(part: Part, lp: list[dict[str, Any]] | None) -> ChatResponse:
        one = Reply()
        one.add([part])
        return answer(chat_message(one), False, logprobs=lp)

    writer = NdjsonWriter(
        chunk, lambda done: answer(empty(), True, **final_fields(done)), prompt.parser()
    )
    return StreamingResponse(pump(state.manager, slot, gen, writer), media_type=NDJSON)
