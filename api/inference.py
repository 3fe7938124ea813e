"""What /api and /v1 share before the first token: request checks, acquiring the model,
rendering and tokenizing the prompt."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxd.api.errors import ApiError
from mlxd.api.state import ServerState
from mlxd.api.types import Message
from mlxd.engine.manager import Loaded
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import ModelNotPulled, Pairing
from mlxd.engine.prompt import encode, render_chat, with_system
from mlxd.registry.schema import ModelEntry

ROLES = ("system", "user", "assistant", "tool")
THINK_LEVELS = ("low", "medium", "high", "max")

# No tokenizer mlxd serves has tokens longer than this many characters, so a prompt longer than
# context * this cannot fit and is refused before it is tokenized (which costs time and memory
# in proportion to its length).
MAX_CHARS_PER_TOKEN = 64


def request_options(entry: ModelEntry, options: dict[str, Any] | None) -> SamplingOptions:
    """The registry's defaults under the request's options (OptionsError: 400)."""
    return parse_options(entry.options, options)


def check_think(think: bool | str | None, entry: ModelEntry) -> None:
    """No model served today has a thinking mode: `think: true` or a level is refused."""
    if think is None or think is False:
        return
    if not (think is True or think in THINK_LEVELS):
        raise ApiError(400, "invalid think value")
    raise ApiError(400, f'"{entry.name}" does not support thinking')


def check_format(fmt: Any) -> None:
    if fmt in (None, ""):
        return
    if fmt != "json" and not isinstance(fmt, dict):
        raise ApiError(
            400, f'invalid format: {json.dumps(fmt)}; expected "json" or a valid JSON Schema object'
        )
    raise ApiError(400, "structured outputs (format) are not supported by mlxd yet")


def native_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Chat messages as the chat template reads them; roles checked and lower-cased."""
    out = []
    for i, msg in enumerate(messages):
        role = (msg.role or "").lower()
        if role not in ROLES:
            raise ApiError(
                400, f"invalid message at index {i}: role must be one of {', '.join(ROLES)}"
            )
        if msg.images:
            raise ApiError(400, "images are not supported by this model")
        clean: dict[str, Any] = {"role": role, "content": msg.content or ""}
        for key in ("tool_calls", "tool_name", "tool_call_id", "thinking"):
            value = getattr(msg, key)
            if value is not None:
                clean[key] = value
        out.append(clean)
    return out


# -- the model and the prompt -------------------------------------------------------------------


async def acquire(
    state: ServerState, entry: ModelEntry, keep_alive: float | None
) -> tuple[Loaded, float]:
    """Hold the model (loading it if needed); QueueFull and ModelUnavailable go to the table."""
    try:
        return await state.manager.acquire(entry, keep_alive)
    except ModelNotPulled as exc:
        raise ApiError(404, f'model "{entry.name}" not found, try pulling it first') from exc


def check_length(pairing: Pairing, opts: SamplingOptions, before: int, text: str) -> None:
    """Refuse, without tokenizing, a prompt too long to fit its row's context whatever its
    tokens."""
    limit = pairing.row_context(opts)
    if before >= limit or len(text) > (limit - before) * MAX_CHARS_PER_TOKEN:
        raise ApiError(
            400,
            f"the input length ({before} tokens and {len(text)} characters) exceeds the"
            f" context length ({limit} tokens)",
        )


def tokenize(
    pairing: Pairing, opts: SamplingOptions, before: list[int], text: str, templated: bool
) -> list[int]:
    tokens = before + encode(pairing.tokenizer, text, templated)
    if not tokens:
        raise ApiError(400, "prompt is empty after rendering")
    context = pairing.row_context(opts)
    if len(tokens) >= context:
        raise ApiError(
            400,
            f"the input length ({len(tokens)} tokens) exceeds the context length "
            f"({context} tokens)",
        )
    return tokens


def chat_renderer(
    entry: ModelEntry, messages: list[dict[str, Any]], tools: list[Any] | None
) -> Callable[[Pairing], str]:
    """How a chat request becomes a prompt for a loaded pairing (native and /v1 alike)."""

    def render(pairing: Pairing) -> str:
        if tools and "tools" not in pairing.capabilities:
            raise ApiError(400, f"{entry.name} does not support tools")
        seeded = [dict(m) for m in entry.messages] + messages  # the model's MESSAGE lines first
        return render_chat(pairing.tokenizer, with_system(seeded, entry.system))

    return render


async def prepare(
    state: ServerState,
    entry: ModelEntry,
    keep_alive: float | None,
    render: Callable[[Pairing], str],
    opts: SamplingOptions,
    before: list[int] | None = None,
    templated: bool = True,
) -> tuple[Loaded, float, list[int]]:
    """Acquire the model, render and tokenize the prompt, which must leave room in its row's
    context; the slot is released if that fails."""
    slot, load_seconds = await acquire(state, entry, keep_alive)
    try:
        pairing = state.manager.pairing(slot)
        text = render(pairing)
        pairing.check_options(opts)
        check_length(pairing, opts, len(before or ()), text)
        tokens = await run_in_threadpool(tokenize, pairing, opts, before or [], text, templated)
    except BaseException:
        state.manager.release(slot)
        raise
    return slot, load_seconds, tokens
