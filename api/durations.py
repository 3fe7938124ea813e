"""keep_alive values as Ollama reads them: seconds, Go duration strings, negative = forever."""

from __future__ import annotations

import math
import re

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class DurationError(ValueError):
    pass


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
        seconds = float(value)
    elif isinstance(value, str):
        seconds = parse_go_duration(value)
    else:
        raise DurationError("keep_alive must be a number of seconds or a duration string")
    return math.inf if seconds < 0 else seconds


def env_keep_alive(value: str | None, default: float = 300.0) -> float:
    """OLLAMA_KEEP_ALIVE / MLXD_KEEP_ALIVE also accept bare integers as seconds."""
    if not value:
        return default
    v = value.strip().strip("\"'")
    try:
        seconds = float(v)
    except ValueError:
        seconds = parse_go_duration(v)
    return math.inf if seconds < 0 else seconds
