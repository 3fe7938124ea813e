"""Shared pytest fixtures for the mlxd test suite."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from mlxd.engine.backend import Backend, configure_backend

configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX before its import

# isort: split
from tests.fixtures.tiny_models import TinyPair, build_pair  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """Build the tiny target/draft pair once per session; building takes well under 1 s."""
    return build_pair(tmp_path_factory.mktemp("models"))


# -- a real server on a free loopback port -------------------------------------------------------

# Every test runs with its own mlxd home and no hub access; the home goes with the process.
os.environ["MLXD_HOME"] = tempfile.mkdtemp(prefix="mlxd-home-")
atexit.register(shutil.rmtree, os.environ["MLXD_HOME"], ignore_errors=True)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.pop("OLLAMA_HOST", None)
os.environ.pop("MLXD_HOST", None)


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll until `check()` holds: for things that settle asynchronously (file watching,
    expiry timers, a disconnect reaching the scheduler). A bound, not a speed threshold."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_registry(path: Path, pair: TinyPair) -> Path:
    """The registry the API tests serve: a plain model, a real pairing and a self-draft."""
    path.write_text(
        "models:\n"
        f"  tiny:\n    target: {pair.target}\n"
        f"  pair:\n    target: {pair.target}\n    draft: {pair.draft}\n"
        f"  selfdraft:\n    target: {pair.target}\n    draft: {pair.target}\n"
        f"  sys:\n    target: {pair.target}\n    system: You are terse.\n"
        "    options:\n      temperature: 0\n      num_predict: 8\n",
        encoding="utf-8",
    )
    return path


@dataclass
class RunningServer:
    base_url: str
    host: str
    port: int
    registry: Path


class ServerThread:
    """uvicorn serving the real app in a background thread of the test process."""

    def __init__(
        self, registry: Path, keep_alive: float = 300.0, max_loaded: int = 3, **settings: Any
    ) -> None:
        """`settings`: further `Settings` fields by name (max_queue, memory_budget, ...)."""
        from mlxd.api.app import build_app
        from mlxd.daemon.config import Settings
        from mlxd.daemon.server import build_state

        self.port = free_port()
        self.state = build_state(
            Settings("127.0.0.1", self.port, registry, keep_alive, max_loaded, **settings),
            configure_backend(),
        )
        config = uvicorn.Config(
            build_app(self.state), host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=5,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.info = RunningServer(f"http://127.0.0.1:{self.port}", "127.0.0.1", self.port, registry)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self.info

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def registry_file(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_registry(tmp_path_factory.mktemp("registry") / "models.yaml", tiny_pair)


@pytest.fixture(scope="session")
def server(registry_file: Path) -> Iterator[RunningServer]:
    """One server for the session; tests that need special settings start their own."""
    with ServerThread(registry_file) as info:
        yield info


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    """The machine's choices as `mlxd serve` makes them; with `gpu_layout`, the GPU's caches."""
    if "gpu_layout" in request.fixturenames:
        return request.getfixturevalue("gpu_layout")  # type: ignore[no-any-return]
    return configure_backend()
