"""Ollama's request `options`, parsed once into a typed value the engine can trust.

Every option has a type and a range (`BOUNDS`); a value outside it is clamped where Ollama's
runner clamps it (a negative seed is a random one, `num_ctx` below 4 is 4, a negative
temperature is greedy) and is an `OptionsError` (a 400) otherwise, so no request can carry a
NaN, an overflowing integer or a penalty that divides by zero into the sampler.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

DRAFT_METHODS = ("auto", "model", "lookup", "forced", "off")  # forced: a grammar's own
MAX_DRAFT_TOKENS = 64  # options.draft_num_predict: drafts per round (verify cost grows with it)
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT_FLOOR = 1e-7  # the least positive temperature, top-p and repeat penalty (`Bound.floor`)

# Options Ollama accepts that do not change how mlxd samples (runner and legacy keys).
_IGNORED = frozenset(
    {
        "num_keep", "typical_p", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread",
        "numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "embedding_only",
        "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline",
        "grammar",  # mlxd's structured output: read by the API (api.structured)
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


@dataclass(frozen=True)
class Bound:
    """The accepted range of one numeric option; `clamp_below` replaces values under `low`
    (Ollama's meaning of such values) instead of refusing them."""

    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself is excluded
    clamp_below: float | None = None
    says: str = ""  # the range in words, for the error message
    # positive values under this are raised to it: the sampler computes in float32, where a
    # temperature of 1e-40 (or a top-p, a penalty of 1e-300) is 0 or overflows the logits it
    # divides, and a request that asked for one got no tokens (Ollama floors temperature alike)
    floor: float = 0.0

    def apply(self, key: str, value: Any) -> int | float:
        number = _as_number(key, value, self.kind)
        if self.clamp_below is not None and number < self.low:
            return self.kind(self.clamp_below)
        too_low = number <= self.low if self.low_open else number < self.low
        if too_low or number > self.high:
            raise OptionsError(f'option "{key}" must be {self.says}')
        return max(number, self.floor) if number > 0 else number


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(
        float, 0.0, 100.0, clamp_below=0.0, says="between 0 and 100", floor=FLOAT_FLOOR
    ),
    "top_k": Bound(int, 0, INT32_MAX, clamp_below=0, says="a 32-bit integer"),
    "top_p": Bound(
        float, 0.0, 1.0, low_open=True, says="greater than 0 and at most 1", floor=FLOAT_FLOOR
    ),
    "min_p": Bound(float, 0.0, 1.0, says="between 0 and 1"),
    "seed": Bound(int, INT64_MIN, INT64_MAX, says="a 64-bit signed integer"),
    "num_predict": Bound(int, -2, INT32_MAX, says="-1, -2 or a count up to 2147483647"),
    "repeat_penalty": Bound(
        float, 0.0, 100.0, low_open=True, says="greater than 0, at most 100", floor=FLOAT_FLOOR
    ),
    "repeat_last_n": Bound(int, -1, INT32_MAX, says="-1, 0 or a count up to 2147483647"),
    "presence_penalty": Bound(float, -100.0, 100.0, says="between -100 and 100"),
    "frequency_penalty": Bound(float, -100.0, 100.0, says="between -100 and 100"),
    "num_ctx": Bound(int, 4, INT32_MAX, clamp_below=4, says="at most 2147483647"),
    "draft_num_predict": Bound(int, 0, MAX_DRAFT_TOKENS, says=f"between 0 and {MAX_DRAFT_TOKENS}"),
    "kv_bits": Bound(int, 4, 8, says="4 or 8"),
    "kv_group_size": Bound(int, 32, 128, says="32, 64 or 128"),
    "quantized_kv_start": Bound(int, 0, INT32_MAX, says="between 0 and 2147483647"),
}
_CHOICES: dict[str, tuple[int, ...]] = {"kv_bits": (4, 8), "kv_group_size": (32, 64, 128)}


def _as_number(key: str, value: Any, kind: type) -> int | float:
    """An int or float option's value; a float given for an integer is truncated, as Ollama's
    options map does; NaN and infinities are refused."""
    name = "integer" if kind is int else "float"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise OptionsError(f'option "{key}" must be of type {name}')
    if isinstance(value, float) and not math.isfinite(value):
        raise OptionsError(f'option "{key}" must be a finite number')
    if kind is float:
        return float(value)
    return int(value)


def _as_stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise OptionsError('option "stop" must be of type array of strings')


def _parse_one(key: str, value: Any) -> Any:
    bound = BOUNDS.get(key)
    if bound is not None:
        number = bound.apply(key, value)
        if key in _CHOICES and number not in _CHOICES[key]:
            raise OptionsError(f'option "{key}" must be {bound.says}')
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
