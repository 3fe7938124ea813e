"""The embedding routes: Ollama's /api/embed and legacy /api/embeddings, and OpenAI's
/v1/embeddings. Inputs are checked and parsed here into one engine request; the vectors come
back L2-normalised from the engine (`engine.embedding`)."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxd.api.codec import json_response, read_request
from mlxd.api.disconnect import while_connected
from mlxd.api.durations import parse_keep_alive
from mlxd.api.errors import ApiError
from mlxd.api.inference import acquire, request_options
from mlxd.api.openai import openai_errors
from mlxd.api.state import ServerState, lookup, state_of
from mlxd.api.types import (
    EmbeddingItem,
    EmbeddingList,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbeddingUsage,
    EmbedRequest,
    EmbedResponse,
    OpenAIEmbeddingRequest,
)
from mlxd.engine.embedding.model import Embedded, NotAnEmbeddingModel
from mlxd.engine.embedding.model import EmbedRequest as EngineRequest
from mlxd.engine.embedding.runner import EmbeddingRunner
from mlxd.engine.embedding.spec import is_generative
from mlxd.registry.schema import ModelEntry

NS = 1_000_000_000


def _texts(value: Any) -> list[str]:
    """Ollama's `input`: a string (empty: none) or a list of strings."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ApiError(400, "invalid input type")


def _dimensions(value: int | None) -> int | None:
    if value is None or value == 0:
        return None
    if value < 0:
        raise ApiError(400, "dimensions must be a positive integer")
    return value


async def _check_embeds(state: ServerState, entry: ModelEntry) -> None:
    """Refuse a generative model without loading it (Ollama: 501); a loaded model's runner
    says, else its files do."""
    loaded = state.manager.loaded().get(entry.name)
    if loaded is not None and loaded.entry == entry:
        if not isinstance(loaded.runner, EmbeddingRunner):
            raise NotAnEmbeddingModel()
        return
    if await run_in_threadpool(is_generative, entry):
        raise NotAnEmbeddingModel()


async def _embed(
    state: ServerState, entry: ModelEntry, request: EngineRequest, keep: float | None
) -> tuple[Embedded, float]:
    """The vectors of `request` on `entry`'s model, and the seconds spent loading it."""
    await _check_embeds(state, entry)
    slot, load_seconds = await acquire(state, entry, keep)
    try:
        out = await state.manager.embed(slot, request)
    finally:
        state.manager.release(slot)
    if not np.isfinite(out.vectors).all():
        raise ApiError(500, "the model produced an embedding with NaN or Inf values")
    return out, load_seconds


async def _load_only(state: ServerState, entry: ModelEntry, keep: float | None) -> None:
    if keep == 0:
        state.manager.unload(entry.name)
        return
    slot, _ = await acquire(state, entry, keep)
    state.manager.release(slot)


# -- Ollama ---------------------------------------------------------------------------------------


# Ollama's embedding routes word a missing model as Go's %q quotes it, and advise a pull
EMBED_NOT_FOUND = 'model "{}" not found, try pulling it first'


async def embed(request: Request) -> Response:
    started = time.perf_counter()
    state = state_of(request)
    body = await read_request(request, EmbedRequest, state.max_body)
    name = body.model or ""
    entry = lookup(state, name, missing=EMBED_NOT_FOUND)
    texts = _texts(body.input)
    opts = request_options(entry, body.options)  # OptionsError: 400
    keep = parse_keep_alive(body.keep_alive)
    dimensions = _dimensions(body.dimensions)
    if not texts:  # Ollama: load the model, answer no vectors
        await _load_only(state, entry, keep)
        return json_response(EmbedResponse(name, []))
    engine_request = EngineRequest(
        tuple(texts),
        truncate=body.truncate is not False,
        dimensions=dimensions,
        num_ctx=opts.num_ctx,
        prefix=body.prefix,
    )
    out, load_seconds = await while_connected(request, _embed(state, entry, engine_request, keep))
    return json_response(
        EmbedResponse(
            name,
            out.vectors.astype(np.float64).tolist(),
            total_duration=int((time.perf_counter() - started) * NS),
            load_duration=int(load_seconds * NS),
            prompt_eval_count=out.prompt_tokens,
        )
    )


async def embeddings(request: Request) -> Response:
    """The legacy route: one `prompt`, one `embedding`."""
    state = state_of(request)
    body = await read_request(request, EmbeddingsRequest, state.max_body)
    name = body.model or ""
    entry = lookup(state, name, missing=EMBED_NOT_FOUND)
    opts = request_options(entry, body.options)
    keep = parse_keep_alive(body.keep_alive)
    if not body.prompt:
        await _load_only(state, entry, keep)
        return json_response(EmbeddingsResponse([]))
    job = EngineRequest((body.prompt,), num_ctx=opts.num_ctx)
    out, _ = await while_connected(request, _embed(state, entry, job, keep))
    return json_response(EmbeddingsResponse(out.vectors[0].astype(np.float64).tolist()))


# -- OpenAI ---------------------------------------------------------------------------------------


def _openai_inputs(value: Any) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...] | None]:
    """OpenAI's `input`: a string ("" is one empty input), strings, one token array or token
    arrays (the model's own ids, embedded as they are)."""
    if value == "":
        return ("",), None
    if isinstance(value, str):
        return (value,), None
    if not isinstance(value, list) or not value:
        raise ApiError(400, "invalid input")
    if all(isinstance(v, str) for v in value):
        return tuple(value), None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ("",), (tuple(value),)
    if all(
        isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        for v in value
    ):
        return tuple("" for _ in value), tuple(tuple(v) for v in value)
    raise ApiError(400, "invalid input")


def _encoded(vector: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    result: list[float] = vector.astype(np.float64).tolist()
    return result


@openai_errors
async def openai_embeddings(request: Request) -> Response:
    state = state_of(request)
    body = await read_request(request, OpenAIEmbeddingRequest, state.max_body)
    name = body.model or ""
    entry = lookup(state, name)
    texts, token_ids = _openai_inputs(body.input)
    fmt = body.encoding_format or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, f"invalid encoding_format {fmt!r}: expected 'float' or 'base64'")
    opts = request_options(entry, None)  # the model's own (its num_ctx), as Ollama's routes
    engine_request = EngineRequest(
        texts,
        dimensions=_dimensions(body.dimensions),
        num_ctx=opts.num_ctx,
        prefix=body.prefix,
        token_ids=token_ids,
    )
    out, _ = await while_connected(request, _embed(state, entry, engine_request, None))
    data = [
        EmbeddingItem("embedding", _encoded(vector, fmt), i) for i, vector in enumerate(out.vectors)
    ]
    usage = EmbeddingUsage(out.prompt_tokens, out.prompt_tokens)
    return json_response(EmbeddingList("list", data, name, usage))


def routes() -> list[Route]:
    return [
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings, methods=["POST"]),
        Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
    ]
