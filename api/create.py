"""Ollama's create flow: `HEAD/POST /api/blobs/sha256:<hex>` (upload, digest verified) and
`POST /api/create` (a new model on an existing base: adapters, parameters, system, template,
messages, or the legacy Modelfile text), answered with Ollama's progress statuses.

A create is checked whole before anything is written (`registry.create`); the registry is
reloaded before `success` goes out, so the model answers as soon as the client sees it. A new
adapter on a loaded base is mounted by the first request for it: the base is not reloaded.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxd.api.codec import NDJSON, ndjson_line, read_request
from mlxd.api.errors import ApiError
from mlxd.api.inference import check_images
from mlxd.api.state import CLOSING, ServerState, state_of
from mlxd.api.types import CreateRequest
from mlxd.engine.options import OptionsError, parse_options
from mlxd.engine.prompt import PromptError, check_template
from mlxd.registry.blobs import BlobError, blob_intact, parse_digest, store_blob
from mlxd.registry.create import CreateError, CreateSpec, create_model, local_path
from mlxd.registry.modelfile import ModelfileError, parse_modelfile
from mlxd.registry.pull import Progress, user_file_in_use
from mlxd.registry.schema import KNOWN_OPTIONS, AdapterRef, RegistryError

__all__ = ["routes"]


def _digest(request: Request) -> str:
    try:
        return parse_digest(request.path_params["digest"])
    except BlobError as exc:
        raise ApiError(400, str(exc)) from exc


async def head_blob(request: Request) -> Response:
    digest = _digest(request)
    if not blob_intact(digest):  # a damaged copy is as good as none: the client sends it again
        raise ApiError(404, f'blob "{digest}" not found')
    return Response(status_code=200)


async def post_blob(request: Request) -> Response:
    digest = _digest(request)
    state = state_of(request)

    async def body() -> AsyncIterator[bytes]:
        async for chunk in request.stream():
            if state.closing.is_set():  # the daemon is stopping: the upload ends now
                raise ApiError(503, CLOSING)
            yield chunk

    try:
        created = await store_blob(digest, body())
    except BlobError as exc:
        raise ApiError(400, str(exc)) from exc
    except OSError as exc:  # an unwritable home, a full disk: the server's, said plainly
        raise ApiError(500, f"could not store the blob: {exc.strerror or exc}") from exc
    return Response(status_code=201 if created else 200)


def _near(here: Path | None, ref: AdapterRef) -> AdapterRef:
    """A Modelfile's adapter path, taken relative to the Modelfile's folder where it is not
    absolute."""
    if here is None or local_path(ref.ref, "adapter path").is_absolute():
        return ref
    return AdapterRef(str(here / ref.ref), ref.scale)


def _parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`parameters` as a request reads its options (Ollama's): null leaves one unset, and a
    whole-number option given a fractional number takes its integer part."""
    out = {}
    for name, value in raw.items():
        if value is None:
            continue
        if KNOWN_OPTIONS.get(name) == "int" and isinstance(value, float) and math.isfinite(value):
            value = int(value)
        out[name] = value
    return out


SEED_ROLES = ("system", "user", "assistant")  # what a model's MESSAGE lines may be


def _message(role: str | None, content: str | None) -> dict[str, str]:
    """A seed message as the entry keeps it: the role lower-cased as a chat's are; another
    role (a tool result, which no seeded call precedes) is refused."""
    role = (role or "user").lower()
    if role not in SEED_ROLES:
        raise ApiError(400, f"invalid message role '{role[:40]}': use system, user or assistant")
    return {"role": role, "content": content or ""}


def _spec(body: CreateRequest) -> CreateSpec:
    name = body.model or body.name
    if not name:
        raise ApiError(400, "model is required")
    if body.quantize:
        raise ApiError(400, "quantization is not supported: create from a quantized model")
    if body.files:
        raise ApiError(
            400, "creating a model from files is not supported; pull the base, then use 'from'"
        )
    spec = CreateSpec(name=name)
    if body.modelfile:
        try:
            parsed = parse_modelfile(body.modelfile)
        except ModelfileError as exc:
            raise ApiError(400, f"invalid modelfile: {exc}") from exc
        try:
            here = local_path(body.path, "path").parent if body.path else None
            spec.adapter_dirs = [_near(here, a) for a in parsed.adapters]
            spec.draft_adapter_dirs = [_near(here, a) for a in parsed.draft_adapters]
        except CreateError as exc:
            raise ApiError(exc.status, str(exc)) from None
        spec.from_ = parsed.from_
        spec.draft = parsed.draft
        spec.parameters = parsed.parameters
        spec.system, spec.template = parsed.system, parsed.template
        spec.messages = parsed.messages or None
        spec.license = parsed.licenses
    spec.from_ = body.from_ or spec.from_
    spec.adapter_blobs = dict(body.adapters or {})
    spec.parameters = {**spec.parameters, **_parameters(body.parameters or {})}
    spec.system = body.system or spec.system
    if body.license:
        spec.license = [body.license] if isinstance(body.license, str) else list(body.license)
    spec.template = body.template or spec.template
    if body.messages is not None:
        for m in body.messages:  # the base is text-only, as every route says
            check_images(m.images, spec.from_ or name)
        spec.messages = [_message(m.role, m.content) for m in body.messages]
    try:  # refused now, not by every request the model gets
        check_template(spec.template)
    except PromptError as exc:
        raise ApiError(400, str(exc)) from exc
    try:  # a value every request would refuse (a top_p of 7, a NaN) is refused now
        parse_options({k: v for k, v in spec.parameters.items() if k in KNOWN_OPTIONS})
    except OptionsError as exc:
        raise ApiError(400, f"invalid parameters: {exc}") from None
    return spec


def _create(state: ServerState, spec: CreateSpec) -> list[Progress]:
    """Run the whole create (quick: files are linked, not copied or converted), then reload."""
    registry = state.registry()
    if not user_file_in_use(registry):
        paths = ", ".join(str(p) for p in registry.paths)
        raise ApiError(
            400, f"cannot create: the server reads its models from {paths} only (--registry)"
        )
    try:
        steps = list(create_model(spec, registry))
    except CreateError as exc:
        raise ApiError(exc.status, str(exc)) from exc
    except (RegistryError, OSError) as exc:
        raise ApiError(500, str(exc)) from exc
    error = state.reload()
    if isinstance(error, Exception):
        raise ApiError(500, f"created {spec.name}, but the registry could not be reloaded: {error}")
    return steps


async def create(request: Request) -> Response:
    state = state_of(request)
    body = await read_request(request, CreateRequest, state.max_body)
    spec = _spec(body)
    steps = await run_in_threadpool(_create, state, spec)
    if body.stream is False:
        return JSONResponse(steps[-1].as_dict())

    async def lines() -> AsyncIterator[bytes]:
        if body.modelfile:
            yield ndjson_line({"status": "parsing modelfile"})
        for step in steps:
            yield ndjson_line(step.as_dict())

    return StreamingResponse(lines(), media_type=NDJSON)


def routes() -> list[Route]:
    return [
        Route("/api/blobs/{digest}", head_blob, methods=["HEAD"]),
        Route("/api/blobs/{digest}", post_blob, methods=["POST"]),
        Route("/api/create", create, methods=["POST"]),
    ]
