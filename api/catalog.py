"""`GET /api/mlxd/registry`: every registered pairing, pulled or not (mlxd's own route).

`/api/tags` lists only models whose files are here, as Ollama's does; a newcomer running
`mlxd list` also wants to see what can be pulled by name, so the CLI reads this instead.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxd.api.codec import json_response
from mlxd.api.state import ServerState, state_of
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import files_present


def entry_status(state: ServerState, entry: ModelEntry, pulled: bool) -> str:
    """`not pulled`, `probing` (opening and checking it), `ok` or `unavailable: why` (also a
    local directory the entry names that is not there: no pull can bring it)."""
    if not pulled:
        adapters = [(a.ref, a.is_path) for a in (*entry.adapters, *entry.draft_adapters)]
        missing = [
            ref
            for ref, local in (
                (entry.target, entry.target_is_path),
                (entry.draft, entry.draft_is_path),
                *adapters,
            )
            if local and ref is not None and not os.path.isdir(ref)
        ]
        return f"unavailable: {missing[0]} does not exist" if missing else "not pulled"
    probed = state.manager.probe_result(entry)
    if probed is None:
        return "probing" if state.manager.probe_pending(entry) else "ok"
    return "ok" if probed.ok else f"unavailable: {probed.reason}"


async def registry_list(request: Request) -> Response:
    state = state_of(request)
    entries = state.registry().entries()
    pulled = await run_in_threadpool(lambda: [files_present(e) for e in entries])
    models: list[dict[str, Any]] = [
        {
            "name": e.name,
            "target": e.target,
            "draft": e.draft,
            "description": e.description,
            "pulled": here,
            "status": entry_status(state, e, here),
        }
        for e, here in zip(entries, pulled, strict=True)
    ]
    return json_response({"models": models})


def routes() -> list[Route]:
    return [Route("/api/mlxd/registry", registry_list, methods=["GET"])]
