"""One rule for how many tokens a row of a pairing may hold: the memory budget counts it, the
API checks prompts against it, and the scheduler stops generation at it.

A pairing's context is fixed when it loads: the entry's `num_ctx` (Ollama's default of 4096 when
it sets none) within the model's trained length (the entry's `context_length`, else its config).
The KV budget reserves that many tokens for every parallel row, so a request's own `num_ctx` may
narrow its row's context but never widen it past what was reserved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.registry.schema import ModelEntry

DEFAULT_NUM_CTX = 4096  # Ollama's default context when nothing sets num_ctx
DEFAULT_CONTEXT_LENGTH = 4096  # a config that names no trained length
_LENGTH_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def trained_length(entry: ModelEntry, config: Mapping[str, Any]) -> int:
    """The longest context the model takes: the entry's override, else its config's."""
    if entry.context_length:
        return entry.context_length
    for scope in (config, config.get("text_config") or {}):
        for key in _LENGTH_KEYS:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_CONTEXT_LENGTH


def row_context(
    entry: ModelEntry, config: Mapping[str, Any], options: SamplingOptions | None = None
) -> int:
    """Tokens (prompt and generated) a row may hold; without `options`, the pairing's context:
    what the memory budget reserves per row."""
    reserved = parse_options(entry.options).num_ctx or DEFAULT_NUM_CTX
    reserved = min(reserved, trained_length(entry, config))
    asked = options.num_ctx if options is not None else None
    return min(asked, reserved) if asked else reserved
