"""What every route shares: the server's state and the registry lookup."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request

from mlxd.api.errors import ApiError
from mlxd.api.limits import DEFAULT_MAX_BODY
from mlxd.engine.manager import ModelManager
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry


@dataclass
class ServerState:
    """What the routes need; `registry` is a callable so a hot reload swaps it atomically."""

    registry: Callable[[], Registry]
    manager: ModelManager
    reload: Callable[[], object] = lambda: None  # re-read the registry files now
    registry_errors: Callable[[], list[str]] = list  # why the last registry edit was not applied
    startup: Callable[[], Awaitable[None]] | None = None  # runs before the server is ready
    shutdown: Callable[[], Awaitable[None]] | None = None
    stop_serving: Callable[[], object] = lambda: None  # told to stop: end requests now (any thread)
    max_body: int = DEFAULT_MAX_BODY  # bytes a request body may have (MLXD_MAX_BODY)


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.mlxd
    return state


def lookup(state: ServerState, name: str, normalized: bool = False) -> ModelEntry:
    """The registry entry for `name` (400 when there is none); the 404 names the model as
    sent (show: normalized)."""
    if not name:
        raise ApiError(400, "model is required")
    try:
        entry = state.registry().get(name)
        shown = parse_name(name).display if normalized else name
    except InvalidModelName as exc:
        raise ApiError(400, "invalid model name") from exc
    if entry is None:
        raise ApiError(404, f"model '{shown}' not found")
    return entry
