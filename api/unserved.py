"""Routes Ollama has that mlxd does not serve: a JSON error saying so and what to do instead,
rather than the bare `404 page not found` a client would read as "wrong address".

Paths no Ollama version has keep Ollama's plain 404 (`app._not_found`).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxd.api.codec import json_response
from mlxd.api.errors import error_response
from mlxd.api.openai import error_body

# 501: the address is right, the server knows it, and will not perform it.
STATUS = 501


@dataclass(frozen=True)
class Unserved:
    path: str
    methods: tuple[str, ...]
    why: str


HUB = "mlxd serves models pulled from the Hugging Face hub"
UNSERVED = (
    Unserved(
        "/api/push",
        ("POST",),
        f"{HUB}; it does not push models: upload with `hf upload` (huggingface_hub) instead",
    ),
    Unserved("/api/status", ("GET",), "mlxd has no cloud models"),
    Unserved("/api/me", ("POST",), "mlxd has no ollama.com account"),
    Unserved("/api/signout", ("POST",), "mlxd has no ollama.com account"),
    Unserved("/api/user/keys/{key:path}", ("DELETE",), "mlxd has no ollama.com account"),
    Unserved("/api/experimental/{name:path}", ("GET", "POST"), "mlxd has no web search"),
    Unserved("/v1/responses", ("POST",), "use /v1/chat/completions"),
    Unserved("/v1/messages", ("POST",), "use /v1/chat/completions or /api/chat"),
    Unserved("/v1/audio/transcriptions", ("POST",), "mlxd serves no audio models"),
)


def message(item: Unserved, path: str) -> str:
    return f"{path} is not supported by mlxd: {item.why}"


def _handler(item: Unserved) -> Route:
    async def answer(request: Request) -> Response:
        text = message(item, request.url.path)
        if request.url.path.startswith("/v1/"):
            return json_response(error_body(STATUS, text), STATUS)
        return error_response(STATUS, text)

    return Route(item.path, answer, methods=list(item.methods))


def routes() -> list[Route]:
    return [_handler(item) for item in UNSERVED]
