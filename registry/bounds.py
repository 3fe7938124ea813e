"""The accepted range of every numeric request option: what a request is refused for (a
400) and what a registry entry, a Modelfile's PARAMETER or the chat's `/set parameter` is
refused for when it is written, rather than by every later request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DRAFT_METHODS = ("auto", "model", "lookup", "forced", "off")  # forced: a grammar's own
MAX_DRAFT_TOKENS = 64  # options.draft_num_predict: drafts per round (verify cost grows with it)
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT_FLOOR = 1e-7  # the least positive temperature, top-p and repeat penalty (`Bound.floor`)


class OptionsError(ValueError):
    """An option has the wrong type or an impossible value (answered with 400)."""


@dataclass(frozen=True)
class Bound:
    """The accepted range of one numeric option; `clamp_below` (`clamp_above`) replaces values
    under `low` (over `high`) with Ollama's meaning of such values instead of refusing them."""

    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself is excluded
    clamp_below: float | None = None
    clamp_above: float | None = None
    says: str = ""  # the range in words, for the error message
    # positive values under this are raised to it: the sampler computes in float32, where a
    # temperature of 1e-40 (or a top-p, a penalty of 1e-300) is 0 or overflows the logits it
    # divides, and a request that asked for one got no tokens (Ollama floors temperature alike)
    floor: float = 0.0

    def apply(self, key: str, value: Any) -> int | float:
        number = _as_number(key, value, self.kind)
        if self.clamp_below is not None and number < self.low:
            return self.kind(self.clamp_below)
        if self.clamp_above is not None and number > self.high:
            return self.kind(self.clamp_above)
        too_low = number <= self.low if self.low_open else number < self.low
        if too_low or number > self.high:
            raise OptionsError(f'option "{key}" must be {self.says}')
        return max(number, self.floor) if number > 0 else number


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(
        float, 0.0, 100.0, clamp_below=0.0, says="between 0 and 100", floor=FLOAT_FLOOR
    ),
    "top_k": Bound(int, 0, INT32_MAX, clamp_below=0, says="a 32-bit integer"),
    # Ollama's samplers take any top-p: 0 or less keeps the most likely token, 1 or more all
    # (a UI's slider at 0 is a request, not an error)
    "top_p": Bound(
        float, FLOAT_FLOOR, 1.0, clamp_below=FLOAT_FLOOR, clamp_above=1.0, says="a number"
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


def check_bound(key: str, value: Any) -> int | float:
    """`value` of numeric option `key` within its range (clamped where Ollama clamps it);
    OptionsError otherwise."""
    bound = BOUNDS[key]
    number = bound.apply(key, value)
    if key in _CHOICES and number not in _CHOICES[key]:
        raise OptionsError(f'option "{key}" must be {bound.says}')
    return number
