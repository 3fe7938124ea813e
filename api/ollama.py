"""Ollama's native routes: version, tags, show, generate and chat."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from mlxd.api.codec import NDJSON, json_response, ndjson_line, read_request
from mlxd.api.durations import parse_keep_alive
from mlxd.api.errors import ApiError
from mlxd.api.inference import (
    acquire,
    chat_renderer,
    check_think,
    native_messages,
    prepare,
    request_options,
)
from mlxd.api.modelinfo import find_local, show_json, tag_json
from mlxd.api.pump import collect, pump
from mlxd.api.state import ServerState, lookup, state_of
from mlxd.api.structured import request_grammar
from mlxd.api.types import (
    ChatRequest,
    ChatResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ModelRequest,
    ResponseMessage,
    TagsResponse,
    VersionResponse,
)
from mlxd.engine.events import Done, GenerationRequest
from mlxd.engine.pairing import Pairing
from mlxd.engine.prompt import render_generate
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
    return json_response(TagsResponse(summaries, warning))


def _unavailable(state: ServerState, entry: ModelEntry) -> str | None:
    """mlxd's extra: why a pairing that failed its probe is not being served."""
    probed = state.manager.probe_result(entry)
    return probed.reason if probed is not None and not probed.ok else None


async def show(request: Request) -> Response:
    state = state_of(request)
    body = await read_request(request, ModelRequest, state.max_body)
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model is required")
    entry = lookup(state, name, normalized=True)
    local = await run_in_threadpool(find_local, entry)
    if local is None:
        raise ApiError(404, f"model '{entry.name}' not found")
    return json_response(show_json(local.usable(), _unavailable(state, entry)))


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
        )
    return out


@dataclass(frozen=True)
class NdjsonWriter:
    """A /api stream: `chunk` makes a partial object, `final` the last one."""

    chunk: Callable[[str], Any]
    final: Callable[[Done], Any]

    def text(self, text: str) -> bytes:
        return ndjson_line(self.chunk(text))

    def done(self, done: Done) -> Iterable[bytes]:
        return (ndjson_line(self.final(done)),)

    def failed(self, message: str) -> bytes:
        return ndjson_line(ErrorResponse(message))


async def _load_or_unload(
    state: ServerState, entry: ModelEntry, keep: float | None, make: Callable[[str], Any]
) -> Response:
    """Empty prompt/messages: load the model, or with keep_alive 0 unload it."""
    if keep == 0:
        state.manager.unload(entry.name)
        return json_response(make("unload"))
    slot, _ = await acquire(state, entry, keep)
    state.manager.release(slot)
    return json_response(make("load"))


# -- generate -------------------------------------------------------------------------------


async def generate(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, GenerateRequest, state.max_body)
    name = body.model or ""
    if not name:
        raise ApiError(404, "model '' not found")
    entry = lookup(state, name)
    prompt, suffix, context = body.prompt or "", body.suffix or "", body.context
    raw = bool(body.raw)
    if raw and (body.template or body.system or context):
        raise ApiError(400, "raw mode does not support template, system, or context")
    grammar = await request_grammar(body.format, body.options)
    check_think(body.think, entry)
    opts = request_options(entry, body.options)
    keep = parse_keep_alive(body.keep_alive)  # DurationError: 400

    if not prompt and not suffix:
        return await _load_or_unload(
            state, entry, keep,
            lambda reason: GenerateResponse(name, now(), "", True, done_reason=reason),
        )  # fmt: skip

    def render(pairing: Pairing) -> str:
        if context:
            _check_ids(context, pairing)
        if raw:
            return prompt
        if suffix and pairing.fim is None:
            raise ApiError(400, f"{entry.name} does not support insert")
        system = body.system or entry.system
        return render_generate(
            pairing.tokenizer, prompt, system, body.template, suffix, pairing.fim
        )

    slot, load_seconds, prompt_tokens = await prepare(
        state, entry, keep, render, opts, list(context or []), templated=not raw, grammar=grammar
    )
    gen = GenerationRequest(
        prompt_tokens, opts, started=started, load_duration=load_seconds, grammar=grammar
    )

    def final(done: Done, text: str = "") -> GenerateResponse:
        tokens = None if raw else prompt_tokens + done.output_tokens
        return GenerateResponse(name, now(), text, True, context=tokens, **final_fields(done))

    if body.stream is False:
        answer = await collect(state.manager, slot, gen)
        return json_response(final(answer.done, answer.text))
    writer = NdjsonWriter(lambda text: GenerateResponse(name, now(), text, False), final)
    return StreamingResponse(pump(state.manager, slot, gen, writer), media_type=NDJSON)


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
    if not name:
        raise ApiError(400, "model is required")
    entry = lookup(state, name)
    messages = native_messages(body.messages or [])
    grammar = await request_grammar(body.format, body.options)
    check_think(body.think, entry)
    opts = request_options(entry, body.options)
    keep = parse_keep_alive(body.keep_alive)  # DurationError: 400

    def answer(content: str, done: bool, **extra: Any) -> ChatResponse:
        return ChatResponse(name, now(), ResponseMessage("assistant", content), done, **extra)

    if not messages:
        return await _load_or_unload(
            state, entry, keep, lambda reason: answer("", True, done_reason=reason)
        )

    render = chat_renderer(entry, messages, body.tools)
    slot, load_seconds, prompt_tokens = await prepare(
        state, entry, keep, render, opts, grammar=grammar
    )
    gen = GenerationRequest(
        prompt_tokens, opts, started=started, load_duration=load_seconds, grammar=grammar
    )
    if body.stream is False:
        whole = await collect(state.manager, slot, gen)
        return json_response(answer(whole.text, True, **final_fields(whole.done)))
    writer = NdjsonWriter(
        lambda text: answer(text, False), lambda done: answer("", True, **final_fields(done))
    )
    return StreamingResponse(pump(state.manager, slot, gen, writer), media_type=NDJSON)
