"""Probe results kept across restarts, so a restart re-measures nothing that did not change.

A result is stored under a key made of everything it depends on: the target's and the draft's
file digests (their revisions), the backend the daemon chose (device, BLAS, compute dtype, cache
layout) and the MLX and mlx-lm versions. Any change there is a new key, hence a new probe; an
unchanged pairing's checks and measured costs (`Costs`: v(L), draft and plain step) are read
back without loading it. Only passed probes are stored: a failure is probed again, in case what
failed (memory, a file being written) is gone. A file that cannot be read is a miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

from mlxd.engine.backend import Backend
from mlxd.engine.speculation import Costs
from mlxd.registry.home import mlxd_home
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import model_digest, resolve_local

log = logging.getLogger(__name__)

FORMAT = 5  # bump when what a probe checks or measures changes (5: 4-bit few-row verify)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


@dataclass(frozen=True)
class ProbeStore:
    """Passed probes as small JSON files in one directory (`$MLXD_HOME/probes`)."""

    root: Path

    @classmethod
    def default(cls) -> ProbeStore:
        return cls(mlxd_home() / "probes")

    def key(self, entry: ModelEntry, backend: Backend) -> str | None:
        """What the entry's probe depends on, hashed; None when its files are not here."""
        target = resolve_local(entry.target)
        draft = resolve_local(entry.draft) if entry.draft else None
        if target is None or (entry.draft and draft is None):
            return None
        parts = {
            "format": FORMAT,
            "target": model_digest(target),
            "draft": model_digest(draft) if draft is not None else None,
            "backend": backend.describe(),
            "mlx": str(getattr(mx, "__version__", "?")),
            "mlx_lm": _version("mlx-lm"),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def load(self, key: str) -> Costs | None:
        """The stored costs; a field a newer mlxd measures that the file lacks keeps its
        default (FORMAT says when that is not good enough)."""
        try:
            data = json.loads((self.root / f"{key}.json").read_text(encoding="utf-8"))
            known = {f.name for f in dataclasses.fields(Costs)}
            tables = ("verify", "draft_batch", "padded")
            values = {k: float(v) for k, v in data.items() if k in known and k not in tables}
            verify = {int(w): float(s) for w, s in data["verify"].items()}
            rows = {int(b): float(s) for b, s in data.get("draft_batch", {}).items()}
            padded = {int(n): int(m) for n, m in data.get("padded", {}).items()}
            return Costs(verify=verify, draft_batch=rows, padded=padded, **values)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def save(self, key: str, costs: Costs) -> None:
        """Atomically (a reader sees the old file or the new one); failures only logged."""
        data = dataclasses.asdict(costs)
        data["verify"] = {str(w): s for w, s in costs.verify.items()}
        data["draft_batch"] = {str(b): s for b, s in costs.draft_batch.items()}
        data["padded"] = {str(n): m for n, m in costs.padded.items()}
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, self.root / f"{key}.json")
        except OSError as exc:
            log.warning("cannot keep the probe result in %s: %s", self.root, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk's half-written file
