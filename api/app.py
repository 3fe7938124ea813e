"""The Starlette application: routes, error handlers and the server state they share."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from mlxd.api import (
    catalog,
    create,
    embeddings,
    lifecycle,
    metrics,
    models,
    ollama,
    openai,
    unserved,
)
from mlxd.api.codec import json_response
from mlxd.api.cors import CorsMiddleware, CorsPolicy
from mlxd.api.errors import STATUS, ApiError, error_handler
from mlxd.api.state import ServerState


async def _not_found(request: Request, exc: Exception) -> Response:
    """Ollama's plain 404 for unknown paths; a model name no route pattern takes (a newline,
    say) under /v1/models/ is still a model that is not found, in OpenAI's JSON."""
    prefix = "/v1/models/"
    if request.url.path.startswith(prefix):
        name = request.url.path[len(prefix) :]
        return json_response(openai.error_body(404, f"model '{name}' not found"), 404)
    return PlainTextResponse("404 page not found", status_code=404)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return PlainTextResponse("405 method not allowed", status_code=405)


def build_app(state: ServerState, bind_host: str = "127.0.0.1") -> Starlette:
    """`bind_host` is the address served on: the Host check applies only on loopback."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if state.startup is not None:
            await state.startup()
        try:
            yield
        finally:
            if state.shutdown is not None:
                await state.shutdown()
            await state.manager.shutdown()

    routes = [
        Route("/", ollama.root, methods=["GET", "HEAD"]),
        Route("/api/version", ollama.version, methods=["GET", "HEAD"]),
        Route("/api/tags", ollama.tags, methods=["GET", "HEAD"]),
        Route("/api/show", ollama.show, methods=["POST"]),
        Route("/api/generate", ollama.generate, methods=["POST"]),
        Route("/api/chat", ollama.chat, methods=["POST"]),
        *lifecycle.routes(),
        *models.routes(),
        *create.routes(),
        *openai.routes(),
        *embeddings.routes(),
        *metrics.routes(),
        *catalog.routes(),
        *unserved.routes(),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            # every type of the status table, and anything else as a 500 (Ollama's body)
            **{kind: error_handler for kind in (ApiError, *STATUS)},
            404: _not_found,
            405: _method_not_allowed,
            Exception: error_handler,
        },
        lifespan=lifespan,
    )
    app.state.mlxd = state
    app.state.metrics = served = metrics.ServerMetrics(state)
    # CORS origins come from MLXD_ORIGINS / OLLAMA_ORIGINS when the app is built
    app.add_middleware(CorsMiddleware, policy=CorsPolicy.from_env(bind_host))
    app.add_middleware(metrics.RequestCounter, metrics=served)  # outermost: counts every answer
    return app
