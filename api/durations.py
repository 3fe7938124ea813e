"""keep_alive values as Ollama reads them: seconds, Go duration strings, negative = forever.

A duration must fit Go's `time.Duration` (about 292 years), as Ollama's must: a larger one, or
NaN, is a `DurationError` (400), so no timer, expiry date or `/api/ps` row ever holds a value
the clock cannot represent. Keeping a model loaded for good is spelled with a negative value.
"""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


# Go's largest Duration, in seconds: (2**63 - 1) ns.
MAX_SECONDS = (2**63 - 1) / 1e9


class DurationError(ValueError):
    pass


def _bounded(seconds: float) -> float:
    """Negative values mean forever (inf); NaN and values past Go's range are refused."""
    if math.isnan(seconds) or seconds > MAX_SECONDS:
        raise DurationError(
            "keep_alive out of range: at most 2562047h (use a negative value to keep the model"
            " loaded)"
        )
    return math.inf if seconds < 0 else seconds


def parse_go_duration(text: str) -> float:
    """Go's time.ParseDuration, in seconds ("1h30m", "-1m", "0")."""
    s = text.strip()
    if s in ("0", "+0", "-0"):
        return 0.0
    sign = -1.0 if s.startswith("-") else 1.0
    body = s.lstrip("+-")
    pos, total = 0, 0.0
    while pos < len(body):
        m = _PART.match(body, pos)
        if m is None:
            if re.fullmatch(r"[\d.]+", body[pos:]):
                raise DurationError(f'time: missing unit in duration "{text}"')
            raise DurationError(f'time: invalid duration "{text}"')
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not body:
        raise DurationError(f'time: invalid duration "{text}"')
    return sign * total


def parse_keep_alive(value: object) -> float | None:
    """Seconds to keep a model loaded: None when absent, inf for negative values."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise DurationError("keep_alive must be a number of seconds or a duration string")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError as exc:
            raise DurationError("keep_alive out of range") from exc
    elif isinstance(value, str):
        seconds = parse_go_duration(value)
    else:
        raise DurationError("keep_alive must be a number of seconds or a duration string")
    return _bounded(seconds)


def env_keep_alive(value: str | None, default: float = 300.0) -> float:
    """OLLAMA_KEEP_ALIVE / MLXD_KEEP_ALIVE also accept bare integers as seconds."""
    if not value:
        return default
    v = value.strip().strip("\"'")
    try:
        seconds = float(v)
    except ValueError:
        seconds = parse_go_duration(v)
    return _bounded(seconds)
