"""Temporary files of killed writers are swept from MLXD_HOME; a live writer's stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxd.registry.leftovers import sweep_leftovers

DIGEST = "ab" * 32


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_a_dead_writers_files_go_and_a_live_ones_stay(tmp_path: Path) -> None:
    dead, alive = dead_pid(), os.getpid()
    for folder in ("blobs", "adapters", "probes"):
        (tmp_path / folder).mkdir()
    left = [
        tmp_path / f".models.yaml.{dead}.140.tmp",
        tmp_path / f".digests.json.{dead}.7.tmp",
        tmp_path / "blobs" / f".sha256-{DIGEST}.{dead}.99.partial",
        tmp_path / "probes" / f".{DIGEST}.{dead}.tmp",  # a probe result a full disk cut short
    ]
    kept = [
        tmp_path / f".models.yaml.{alive}.140.tmp",
        tmp_path / "blobs" / f".sha256-{DIGEST}.{alive}.99.partial",
        tmp_path / "blobs" / f"sha256-{DIGEST}",
        tmp_path / "probes" / f".{DIGEST}.{alive}.tmp",
        tmp_path / "probes" / f"{DIGEST}.json",
        tmp_path / "models.yaml",
    ]
    for path in left + kept:
        path.write_bytes(b"x")
    building = tmp_path / "adapters" / f".{DIGEST}.{dead}.partial"
    building.mkdir()
    (building / "adapters.safetensors").write_bytes(b"x")
    assert sweep_leftovers(tmp_path) == 5
    assert not any(p.exists() for p in [*left, building])
    assert all(p.exists() for p in kept)
    assert sweep_leftovers(tmp_path / "absent") == 0
