"""How a registry entry is served over several processes (`distributed:` in models.yaml).

    distributed:
      hosts: [127.0.0.1, 127.0.0.1]   # one rank per entry; rank 0 must be this machine
      # or hostfile: ./hosts.json     # MLX's own hostfile (see `mlx.launch --help`)
      backend: ring                   # ring | jaccl | nccl | auto (MLX picks: nccl on CUDA)
      strategy: tensor                # tensor (model.shard) | pipeline (model.pipeline)

The ranks are launched with MLX's launcher (`mlx.launch`); this module only validates what the
file says, so it never imports mlx.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BACKENDS: tuple[str, ...] = ("ring", "jaccl", "nccl", "auto")
STRATEGIES: tuple[str, ...] = ("tensor", "pipeline")
KEYS: tuple[str, ...] = ("hosts", "hostfile", "backend", "strategy", "port", "timeout")
DEFAULT_TIMEOUT = 120.0


@dataclass(frozen=True)
class Distribution:
    """Where the ranks of a sharded target run and how it is split between them."""

    hosts: tuple[str, ...] = ()
    hostfile: str | None = None
    backend: str = "ring"
    strategy: str = "tensor"
    port: int | None = None  # the ring's first port (None: a free one on this machine)
    timeout: float = DEFAULT_TIMEOUT  # seconds the ranks may take to start or to answer

    @property
    def namespace(self) -> str:
        """What about the split changes a rank's K/V (part of prefix-cache namespaces)."""
        return f"{self.strategy}x{self.world_size}"

    @property
    def world_size(self) -> int:
        """Ranks when hosts are listed (a hostfile's count is read when launching)."""
        return len(self.hosts)


def _describe(value: Any) -> str:
    return repr(value) if not isinstance(value, Mapping) else "a mapping"


def check_distributed(value: Any, base_dir: Path) -> Distribution:
    """Validate a `distributed:` mapping; ValueError says what is wrong."""
    if not isinstance(value, Mapping):
        raise ValueError(f"expected a mapping with 'hosts' or 'hostfile', got {_describe(value)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (expected one of: {', '.join(KEYS)})")
    hosts_raw, hostfile_raw = value.get("hosts"), value.get("hostfile")
    if (hosts_raw is None) == (hostfile_raw is None):
        raise ValueError("expected exactly one of 'hosts' (a list) or 'hostfile' (a path)")
    hosts: tuple[str, ...] = ()
    hostfile = None
    if hosts_raw is not None:
        if not isinstance(hosts_raw, list) or not all(
            isinstance(h, str) and h.strip() and "," not in h for h in hosts_raw
        ):
            raise ValueError(f"'hosts': expected a list of host names, got {_describe(hosts_raw)}")
        if len(hosts_raw) < 2:
            raise ValueError("'hosts': a distributed pairing needs at least two ranks")
        hosts = tuple(h.strip() for h in hosts_raw)
    else:
        if not isinstance(hostfile_raw, str) or not hostfile_raw.strip():
            raise ValueError(f"'hostfile': expected a path, got {_describe(hostfile_raw)}")
        path = os.path.expanduser(hostfile_raw.strip())
        hostfile = path if os.path.isabs(path) else str((base_dir / path).resolve())
    backend = value.get("backend", "ring")
    if backend not in BACKENDS:
        raise ValueError(f"'backend': expected one of {', '.join(BACKENDS)}, got {backend!r}")
    strategy = value.get("strategy", "tensor")
    if strategy not in STRATEGIES:
        raise ValueError(f"'strategy': expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    port = value.get("port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ValueError(f"'port': expected a TCP port number, got {_describe(port)}")
    timeout = value.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(
            f"'timeout': expected a positive number of seconds, got {_describe(timeout)}"
        )
    return Distribution(hosts, hostfile, backend, strategy, port, float(timeout))
