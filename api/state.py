"""What every route shares: the server's state and the registry lookup."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from mlxd.api.errors import ApiError
from mlxd.api.limits import DEFAULT_MAX_BODY
from mlxd.engine.manager import CLOSING, ModelManager
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry

__all__ = ["CLOSING", "ServerState", "lookup", "state_of"]


@dataclass
class ServerState:
    """What the routes need; `registry` is a callable so a hot reload swaps it atomically."""

    registry: Callable[[], Registry]
    manager: ModelManager
    reload: Callable[[], object] = lambda: None  # re-read the registry files now
    registry_errors: Callable[[], list[str]] = list  # why the last registry edit was not applied
    startup: Callable[[], Awaitable[None]] | None = None  # runs before the server is ready
    shutdown: Callable[[], Awaitable[None]] | None = None
    stop_engine: Callable[[], object] = lambda: None  # end the engine's requests (any thread)
    max_body: int = DEFAULT_MAX_BODY  # bytes a request body may have (MLXD_MAX_BODY)
    closing: threading.Event = field(default_factory=threading.Event)  # told to stop
    pulls: set[threading.Event] = field(default_factory=set)  # running pulls' cancel flags

    def stop_serving(self) -> None:
        """Told to stop (from any thread: a signal handler): every request in flight ends now
        with an error line (a generation, a pull, an upload), so the server's connections
        close at once instead of at its graceful-shutdown timeout."""
        self.closing.set()
        for cancel in list(self.pulls):
            cancel.set()
        self.stop_engine()


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.mlxd
    return state


NOT_FOUND = "model '{}' not found"


def lookup(
    state: ServerState,
    name: str,
    normalized: bool = False,
    *,
    missing: str = NOT_FOUND,
    invalid: ApiError | None = None,
) -> ModelEntry:
    """The registry entry for `name` (400 when there is none); the 404 names the model as
    sent (show: normalized) in its route's words (`missing`), and `invalid` is what a name
    that cannot be one answers there (as Ollama's routes differ: 400 "invalid model name")."""
    if not name:
        raise ApiError(400, "model is required")
    try:
        entry = state.registry().get(name)
        shown = parse_name(name).display if normalized else name
    except InvalidModelName as exc:
        raise (invalid or ApiError(400, "invalid model name")) from exc
    if entry is None:
        raise ApiError(404, missing.format(shown))
    return entry
