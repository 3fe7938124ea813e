"""Ollama's request `options`, parsed once into a typed value the engine can trust.

Every option has a type and a range (`BOUNDS`); a value outside it is clamped where Ollama's
runner clamps it (a negative seed is a random one, `num_ctx` below 4 is 4, a negative
temperature is greedy) and is an `OptionsError` (a 400) otherwise, so no request can carry a
NaN, an overflowing integer or a penalty that divides by zero into the sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mlxd.registry.bounds import (
    BOUNDS,
    DRAFT_METHODS,
    OptionsError,
    check_bound,
)

log = logging.getLogger(__name__)

# Options Ollama accepts that do not change how mlxd samples (runner and legacy keys).
_IGNORED = frozenset(
    {
        "num_keep", "typical_p", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread",
        "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "embedding_only",
        "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
        "grammar",  # mlxd's structured output: read by the API (api.structured)
    }
)  # fmt: skip


@dataclass(frozen=True)
class SamplingOptions:
    """Defaults follow Ollama's `DefaultOptions()`; `draft_method` is mlxd's own."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    seed: int | None = None
    num_predict: int = -1
    stop: tuple[str, ...] = ()
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_ctx: int | None = None
    draft_num_predict: int | None = None
    draft_method: str = "auto"
    kv_bits: int | None = None  # quantize the KV cache (4 or 8), as OLLAMA_KV_CACHE_TYPE does
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    # not an Ollama option: the request's `logprobs`/`top_logprobs` (None: none; k: the k
    # most likely tokens besides the chosen one's), set by the API after parsing
    top_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def regime(self) -> str:
        """Greedy and sampled decoding accept drafts at very different rates, so a pairing's
        speculation history is kept per regime."""
        return "greedy" if self.greedy else "sampled"

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _as_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise OptionsError('option "stop" must be of type array of strings')


def _parse_one(key: str, value: Any) -> Any:
    if key in BOUNDS:
        number = check_bound(key, value)
        if key == "seed" and number < 0:
            return None  # Ollama: -1 (any negative) means a random seed
        return number
    if key == "stop":
        return _as_stop(value)
    if key == "draft_method":
        if value not in DRAFT_METHODS:
            raise OptionsError(f'option "draft_method" must be one of {", ".join(DRAFT_METHODS)}')
        return value
    raise AssertionError(f"option {key} has no parser")  # every field has one (tested)


# Fields the API sets from the request's own fields, never from `options`.
NOT_OPTIONS = frozenset({"top_logprobs"})


def parse_options(*layers: Mapping[str, Any] | None) -> SamplingOptions:
    """Merge option layers (registry defaults first, request last) into one value.

    Unknown keys are ignored with a log line, as Ollama does; wrong types and values out of
    range are errors.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, Mapping):
            raise OptionsError("options must be an object")
        merged.update(layer)
    known = {f.name for f in fields(SamplingOptions)} - NOT_OPTIONS
    values: dict[str, Any] = {}
    for key, value in merged.items():
        if key not in known:
            if key not in _IGNORED:
                log.warning("invalid option provided: %.100s", key)
            continue
        if value is None:
            continue
        values[key] = _parse_one(key, value)
    return SamplingOptions(**values)
