"""Fixtures for pull tests: a local hub serving the tiny models, and an environment pointing
huggingface_hub and mlxd at it (own HF cache, own MLXD_HOME, online)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import mlxd.registry.pull as pull_module
from tests.conftest import RunningServer, ServerThread, free_port
from tests.fixtures.tiny_models import TinyPair
from tests.pull.hubserver import HubServer

REPO = Path(__file__).resolve().parents[2]
TARGET_REPO = "org/tiny"
DRAFT_REPO = "org/tiny-draft"
GREEDY = {"num_predict": 8, "temperature": 0}


@dataclass(frozen=True)
class HubEnv:
    hub: HubServer
    pair: TinyPair
    home: Path  # MLXD_HOME
    hf_home: Path

    @property
    def user_file(self) -> Path:
        return self.home / "models.yaml"

    @property
    def cache(self) -> Path:
        return self.hf_home / "hub"

    def storage(self, repo_id: str) -> Path:
        return self.cache / ("models--" + repo_id.replace("/", "--"))


@pytest.fixture
def hub(tiny_pair: TinyPair) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo(TARGET_REPO, tiny_pair.target)
        server.add_repo(DRAFT_REPO, tiny_pair.draft)
        yield server


@pytest.fixture
def hub_env(
    hub: HubServer, tiny_pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> HubEnv:
    """HF_ENDPOINT at the local hub, a fresh HF cache and MLXD_HOME, offline mode off.

    Downloads read 16 KiB at a time so that a connection cut mid-file leaves whole chunks on
    disk and the retry asks for a Range (the tiny weights are ~400 KB).
    """
    env = HubEnv(hub, tiny_pair, tmp_path / "home", tmp_path / "hf")
    for var in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "MLXD_REGISTRY",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(env.hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("MLXD_HOME", str(env.home))
    monkeypatch.setattr(pull_module, "DOWNLOAD_CHUNK", 16 * 1024)
    return env


def base_registry(path: Path) -> Path:
    """Registry entries naming models that exist only on the local hub."""
    path.write_text(
        "version: 1\n"
        "models:\n"
        f"  hubtiny:\n    target: {TARGET_REPO}\n"
        "    options:\n      num_predict: 8\n      temperature: 0\n"
        f"  hubpair:\n    target: {TARGET_REPO}\n    draft: {DRAFT_REPO}\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture
def mlxd(
    hub_env: HubEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningServer]:
    """A real server reading a base registry plus the user registry (as without --registry),
    so models pulled by hub name are served at once."""
    base = base_registry(tmp_path / "base.yaml")
    monkeypatch.setenv("MLXD_REGISTRY", f"{base}{os.pathsep}{hub_env.user_file}")
    with ServerThread(None) as info:  # type: ignore[arg-type]
        yield info


@pytest.fixture
def mlxd_fixed(hub_env: HubEnv, tmp_path: Path) -> Iterator[RunningServer]:
    """A real server started with --registry (the user registry is not read)."""
    with ServerThread(base_registry(tmp_path / "fixed.yaml")) as info:
        yield info


def cli(args: list[str], server: RunningServer, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run the real `mlxd` CLI against ``server`` (stdin and stdout are not terminals)."""
    env = dict(os.environ)
    env.pop("OLLAMA_HOST", None)
    env["MLXD_HOST"] = f"127.0.0.1:{server.port}"
    env["PYTHONIOENCODING"] = "utf-8"
    return subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )


def unused_endpoint() -> str:
    """An address where nothing listens: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"
