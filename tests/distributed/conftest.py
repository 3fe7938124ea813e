"""A real server whose `dist` pairing is the tiny target sharded over two ring ranks on
loopback, next to `local`, the same pairing in one process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxd.engine.distributed.group import free_port, launcher
from tests.conftest import RunningServer, ServerThread
from tests.fixtures.tiny_models import TinyPair

RING_CHECK = (
    "import mlx.core as mx; g = mx.distributed.init(backend='ring', strict=True); "
    "x = mx.distributed.all_sum(mx.ones(1), group=g); mx.eval(x); assert x.item() == 2"
)


def ring_works() -> str | None:
    """None when two ring ranks can start on loopback here; else why not."""
    cmd = [*launcher(), "--backend", "ring", "--hosts", "127.0.0.1,127.0.0.1"]
    cmd += ["--starting-port", str(free_port(2)), "--", sys.executable, "-c", RING_CHECK]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr or done.stdout)[-500:]


def distributed_registry(path: Path, pair: TinyPair, strategy: str = "tensor") -> Path:
    path.write_text(
        "models:\n"
        f"  local:\n    target: {pair.target}\n    draft: {pair.draft}\n"
        f"  dist:\n    target: {pair.target}\n    draft: {pair.draft}\n"
        "    distributed:\n      hosts: [127.0.0.1, 127.0.0.1]\n"
        f"      backend: ring\n      strategy: {strategy}\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def dist_server(
    tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    why = ring_works()
    if why is not None:
        pytest.skip(f"MLX's ring backend cannot start two ranks on loopback here: {why}")
    registry = distributed_registry(tmp_path_factory.mktemp("dist") / "models.yaml", tiny_pair)
    with ServerThread(registry) as info:
        yield info
