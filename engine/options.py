"""Ollama's request `options`, parsed once into a typed value the engine can trust."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

log = logging.getLogger(__name__)

DRAFT_METHODS = ("auto", "model", "lookup", "off")

# Options Ollama accepts that do not change how mlxd samples (runner and legacy keys).
_IGNORED = frozenset(
    {
        "num_keep", "typical_p", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread",
        "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "embedding_only",
        "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
    }
)  # fmt: skip


class OptionsError(ValueError):
    """An option has the wrong type or an impossible value (answered with 400)."""


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


_INT = {
    "top_k", "seed", "num_predict", "repeat_last_n", "num_ctx", "draft_num_predict",
    "kv_bits", "kv_group_size", "quantized_kv_start",
}  # fmt: skip
_FLOAT = {
    "temperature",
    "top_p",
    "min_p",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
}


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise OptionsError(f'option "{key}" must be of type integer')
    return int(value)


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise OptionsError(f'option "{key}" must be of type float')
    return float(value)


def _as_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise OptionsError('option "stop" must be of type array of strings')


def parse_options(*layers: Mapping[str, Any] | None) -> SamplingOptions:
    """Merge option layers (registry defaults first, request last) into one value.

    Unknown keys are ignored with a log line, as Ollama does; wrong types are errors.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, Mapping):
            raise OptionsError("options must be an object")
        merged.update(layer)
    known = {f.name for f in fields(SamplingOptions)}
    values: dict[str, Any] = {}
    for key, value in merged.items():
        if key not in known:
            if key not in _IGNORED:
                log.warning("invalid option provided: %s", key)
            continue
        if value is None:
            continue
        if key in _INT:
            values[key] = _as_int(key, value)
        elif key in _FLOAT:
            values[key] = _as_float(key, value)
        elif key == "stop":
            values[key] = _as_stop(value)
        elif key == "draft_method":
            if value not in DRAFT_METHODS:
                raise OptionsError(
                    f'option "draft_method" must be one of {", ".join(DRAFT_METHODS)}'
                )
            values[key] = value
    seed = values.get("seed")
    if seed is not None and seed < 0:
        values["seed"] = None  # Ollama: -1 means a random seed
    if values.get("kv_bits") not in (None, 4, 8):
        raise OptionsError('option "kv_bits" must be 4 or 8')
    if values.get("kv_group_size", 64) not in (32, 64, 128):
        raise OptionsError('option "kv_group_size" must be 32, 64 or 128')
    opts = SamplingOptions(**values)
    if opts.top_p <= 0.0 or opts.top_p > 1.0:
        opts = replace(opts, top_p=1.0)
    if opts.num_ctx is not None and opts.num_ctx < 4:
        opts = replace(opts, num_ctx=4)
    return opts
