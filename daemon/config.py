"""Daemon settings from the environment, with Ollama's variable names as fallbacks."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mlxd.api.durations import DurationError, env_keep_alive
from mlxd.api.limits import DEFAULT_MAX_BODY

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434


class ConfigError(ValueError):
    pass


def env(environ: Mapping[str, str], name: str) -> str | None:
    """MLXD_<name>, else OLLAMA_<name>; trimmed of spaces and quotes as Ollama does."""
    for prefix in ("MLXD_", "OLLAMA_"):
        value = environ.get(prefix + name)
        if value is not None and value.strip().strip("\"'"):
            return value.strip().strip("\"'")
    return None


def parse_host(value: str | None) -> tuple[str, int]:
    """OLLAMA_HOST rules: scheme optional; port 11434 without a scheme, 80/443 with one."""
    if not value:
        return DEFAULT_HOST, DEFAULT_PORT
    text = value.strip()
    scheme, sep, rest = text.partition("://")
    default_port = (
        {"http": 80, "https": 443}.get(scheme.lower(), DEFAULT_PORT) if sep else DEFAULT_PORT
    )
    address = (rest if sep else text).split("/", 1)[0]
    if address.count(":") > 1 and not address.startswith("["):  # a bare IPv6 address (`::1`)
        try:
            return str(ipaddress.IPv6Address(address)), default_port
        except ValueError as exc:
            raise ConfigError(f"invalid host {value!r}: {exc}") from exc
    if not sep:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid host {value!r}: {exc}") from exc
    # `:PORT` names no host: every interface, as Ollama listens on `:PORT`
    host = parts.hostname or ("0.0.0.0" if address.startswith(":") else DEFAULT_HOST)
    return host, port if port is not None else default_port


def client_base_url(environ: Mapping[str, str] = os.environ) -> str:
    """Where the CLI reaches the daemon: the same variable, keeping an https scheme and path."""
    raw = env(environ, "HOST")
    host, port = parse_host(raw)
    scheme = "https" if raw and raw.strip().lower().startswith("https://") else "http"
    path = urlsplit(raw if raw and "://" in raw else f"http://{raw or ''}").path.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{path}"


def _keep_alive(value: str | None) -> float:
    try:
        return env_keep_alive(value)
    except DurationError as exc:
        raise ConfigError(f"invalid KEEP_ALIVE {value!r}: {exc}") from exc


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: str) -> int:
    """`8GiB`, `512MB`, `1048576`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", value)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {value!r} (examples: 2GiB, 512MB, 1048576)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _size(environ: Mapping[str, str], name: str, default: int) -> int:
    value = env(environ, name)
    return parse_bytes(value) if value else default


def _count(environ: Mapping[str, str], name: str, default: int) -> int:
    """A positive integer setting; unset, 0 or negative means the default."""
    value = env(environ, name)
    try:
        number = int(value) if value else 0
    except ValueError as exc:
        raise ConfigError(f"invalid {name} {value!r}: expected an integer") from exc
    return number if number > 0 else default


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """A duration in seconds (0 or negative: off); unset means the default."""
    value = environ.get(name, "").strip().strip("\"'")
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError as exc:
        raise ConfigError(f"invalid {name} {value!r}: expected seconds") from exc


def _max_body(environ: Mapping[str, str]) -> int:
    size = _size(environ, "MAX_BODY", DEFAULT_MAX_BODY)
    if size <= 0:
        raise ConfigError(f"invalid MAX_BODY {env(environ, 'MAX_BODY')!r}: must be positive")
    return size


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    registry: Path | None
    keep_alive: float
    max_loaded: int
    cache_ram_bytes: int = 2 * 2**30  # prefix cache, RAM tier
    cache_ssd_bytes: int = 20 * 2**30  # prefix cache, SSD tier (0 turns it off)
    cache_dir: Path | None = None  # default: $MLXD_HOME/kvcache
    max_queue: int = 512  # requests waiting for a model before 503
    num_parallel: int = 4  # rows per loaded pairing (KV budget and scheduler)
    memory_budget: int | None = None  # bytes for loaded pairings; None: 75% of total memory
    runner_stall_s: float = 120.0  # a runner stuck this long in one step is reloaded (0: never)
    max_body: int = DEFAULT_MAX_BODY  # bytes a request body may have (413 above)
    adapter_bytes: int | None = None  # adapters kept resident per loaded model; None: 2 GiB

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] = os.environ, registry: Path | None = None
    ) -> Settings:
        host, port = parse_host(env(environ, "HOST"))
        budget = env(environ, "MEMORY_BUDGET")
        adapters = env(environ, "ADAPTER_BYTES")
        return cls(
            host=host,
            port=port,
            registry=registry,
            keep_alive=_keep_alive(env(environ, "KEEP_ALIVE")),
            max_loaded=_count(environ, "MAX_LOADED_MODELS", 3),
            cache_ram_bytes=_size(environ, "CACHE_RAM", 2 * 2**30),
            cache_ssd_bytes=_size(environ, "CACHE_SSD", 20 * 2**30),
            cache_dir=Path(environ["MLXD_CACHE_DIR"]) if environ.get("MLXD_CACHE_DIR") else None,
            max_queue=_count(environ, "MAX_QUEUE", 512),
            num_parallel=_count(environ, "NUM_PARALLEL", 4),
            memory_budget=parse_bytes(budget) if budget else None,
            runner_stall_s=_seconds(environ, "MLXD_RUNNER_STALL_S", 120.0),
            max_body=_max_body(environ),
            adapter_bytes=parse_bytes(adapters) if adapters else None,
        )
