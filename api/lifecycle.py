"""Loaded models: `GET /api/ps` in Ollama's shape and `GET /api/mlxd/stats`, mlxd's counters.

The stats object is built from the small functions in `STATS`, one per top-level key; a new
section (e.g. the prefix cache's) is one more entry there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlxd.api.codec import json_response
from mlxd.api.durations import MAX_SECONDS
from mlxd.api.modelinfo import LocalModel, find_local
from mlxd.api.state import ServerState, state_of
from mlxd.api.types import PsResponse, RunningModel
from mlxd.engine.manager import ModelStatus
from mlxd.registry.schema import ModelEntry, rfc3339

# Go's largest Duration, as Ollama stores a negative keep_alive: "forever" lands in 2318.
FOREVER_SECONDS = MAX_SECONDS


def expires_at(status: ModelStatus, now: datetime) -> str:
    """Never past "forever": keep_alive is bounded at the edge, and this bound keeps one bad
    value from breaking the listing for every client."""
    wall, left_s = status.expires_wall, status.expires_in
    if wall is not None and left_s is not None and left_s < FOREVER_SECONDS:
        return rfc3339(datetime.fromtimestamp(wall, timezone.utc))
    left = FOREVER_SECONDS if status.expires_in is None else min(status.expires_in, FOREVER_SECONDS)
    return rfc3339(now + timedelta(seconds=left))


def keep_alive_json(seconds: float) -> float:
    """Seconds; -1 for forever (as Ollama re-marshals a negative duration)."""
    return -1 if math.isinf(seconds) else seconds


def _by_expiry(statuses: list[ModelStatus]) -> list[ModelStatus]:
    """Latest expiry first, as Ollama sorts /api/ps."""
    return sorted(statuses, key=lambda s: math.inf if s.expires_in is None else s.expires_in)[::-1]


def _local(entry: ModelEntry) -> LocalModel | None:
    try:
        return find_local(entry)
    except Exception:  # files vanished or broke while loaded: still list the model
        return None


# -- /api/ps ---------------------------------------------------------------------------------


def ps_entry(
    status: ModelStatus,
    local: LocalModel | None,
    now: datetime,
    on_gpu: bool = True,
    name: str | None = None,
) -> RunningModel:
    """`size_vram` is what the accelerator holds: all of it on a GPU (MLX's memory is
    unified), none on a CPU-only host (`ollama ps` then prints 100% CPU). `name`: which of
    the entries it serves, the row's name (default: the one it was loaded for)."""
    size = status.need.total
    name = name or status.entry.name
    return RunningModel(
        name=name,
        model=name,
        size=size,
        size_vram=size if on_gpu else 0,
        digest=local.digest if local is not None else "",
        details=local.details.ollama_details() if local is not None else {},
        expires_at=expires_at(status, now),
        context_length=status.need.context,
        ranks=list(status.ranks) or None,
        serves=list(status.names) if len(status.names) > 1 else None,
    )


async def ps(request: Request) -> Response:
    manager = state_of(request).manager
    statuses = _by_expiry(manager.status())
    locals_ = await run_in_threadpool(lambda: [_local(s.entry) for s in statuses])
    now = datetime.now(timezone.utc)
    on_gpu = manager.backend.device == "gpu"
    models = [
        ps_entry(s, local, now, on_gpu, s.name) for s, local in zip(statuses, locals_, strict=True)
    ]  # a base several entries share (adapters) is one row: its memory counted once
    return json_response(PsResponse(models))


# -- /api/mlxd/stats -------------------------------------------------------------------------

StatsPart = Callable[[ServerState], Any]


def model_stats(status: ModelStatus, now: datetime) -> dict[str, Any]:
    need = status.need
    return {
        "name": status.name,  # as /api/ps names it
        "loading": status.loading,
        "stopping": status.stopping,
        "active": status.active,
        "waiting": status.waiting,
        "size": need.total,
        "weights_bytes": need.weights,
        "kv_bytes": need.kv,
        "overhead_bytes": need.overhead,
        "context_length": need.context,
        "parallel": need.rows,
        "keep_alive": keep_alive_json(status.keep_alive),
        "expires_in": status.expires_in,
        "expires_at": expires_at(status, now),
    }


def _models(state: ServerState) -> list[dict[str, Any]]:
    now = datetime.now(timezone.utc)
    return [model_stats(s, now) for s in _by_expiry(state.manager.status())]


def _totals(state: ServerState) -> dict[str, int]:
    statuses = state.manager.status()
    return {
        "loaded": len(statuses),
        "active": sum(s.active for s in statuses),
        "waiting": sum(s.waiting for s in statuses),
        "size": sum(s.need.total for s in statuses),
    }


def _queue(state: ServerState) -> dict[str, int]:
    queue = state.manager.queue
    return {"waiting": queue.count, "max": queue.limit}


def _memory(state: ServerState) -> dict[str, Any]:
    manager = state.manager
    used = manager.memory_used()
    return {
        "budget": manager.budget.bytes,
        "budget_source": manager.budget.source,
        "used": used,
        "free": max(0, manager.budget.bytes - used),
    }


def _limits(state: ServerState) -> dict[str, Any]:
    manager = state.manager
    return {
        "max_loaded_models": manager.max_loaded,
        "num_parallel": manager.num_parallel,
        "default_keep_alive": keep_alive_json(manager.default_keep_alive),
        "runner_stall_s": manager.stall_limit,
        "runner_stalls": manager.stalls,
    }


def _device(state: ServerState) -> str:
    return state.manager.backend.device


def _prefix_cache(state: ServerState) -> dict[str, Any]:
    """Tier sizes, hit rate (token-weighted) and bytes restored."""
    prefix = state.manager.prefix
    return prefix.snapshot() if prefix is not None else {}


def _registry_errors(state: ServerState) -> list[str]:
    """Why the last edit of the registry files was not applied (the last good one serves)."""
    return state.registry_errors()


STATS: dict[str, StatsPart] = {
    "models": _models,
    "prefix_cache": _prefix_cache,
    "totals": _totals,
    "queue": _queue,
    "memory": _memory,
    "limits": _limits,
    "device": _device,
    "registry_errors": _registry_errors,
}


def stats_json(state: ServerState) -> dict[str, Any]:
    return {name: part(state) for name, part in STATS.items()}


async def stats(request: Request) -> Response:
    return JSONResponse(stats_json(state_of(request)))


def routes() -> list[Route]:
    return [
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/mlxd/stats", stats, methods=["GET"]),
    ]
