"""Adapters named by their hub repository in a registry entry: pulled with the entry, served,
deleted with it; a bare adapter repository is refused as a model."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from mlxd.registry.store import resolve_adapter
from tests.conftest import RunningServer, ServerThread, wait_for
from tests.fixtures.adapters import train_adapter
from tests.pull.conftest import GREEDY, TARGET_REPO, HubEnv, cli

ADAPTER_REPO = "org/tiny-sql-lora"
PROMPT = "SELECT name FROM"


@pytest.fixture
def adapter(hub_env: HubEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real adapter of the hub's target, served by the hub as a training run's folder
    (with a numbered checkpoint beside the final weights, which a pull leaves)."""
    folder = train_adapter(
        hub_env.pair.target, tmp_path_factory.mktemp("sql"), "SELECT id FROM users;", seed=1
    )
    shutil.copy(folder / "adapters.safetensors", folder / "0000010_adapters.safetensors")
    hub_env.hub.add_repo(ADAPTER_REPO, folder)
    return folder


@pytest.fixture
def served(
    hub_env: HubEnv, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningServer]:
    base = tmp_path / "base.yaml"
    base.write_text(
        "models:\n"
        f"  hubtiny:\n    target: {TARGET_REPO}\n"
        f"  hubsql:\n    target: {TARGET_REPO}\n    adapters: [{ADAPTER_REPO}]\n"
        f"  localsql:\n    target: {TARGET_REPO}\n    adapters: [{adapter}]\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("MLXD_REGISTRY", f"{base}{os.pathsep}{hub_env.user_file}")
    with ServerThread(None) as info:  # type: ignore[arg-type]
        yield info


def names(server: RunningServer) -> list[str]:
    return [m["name"] for m in httpx.get(f"{server.base_url}/api/tags").json()["models"]]


def test_an_entry_on_a_hub_adapter_is_pulled_with_it_and_served(
    served: RunningServer, hub_env: HubEnv
) -> None:
    """The entry lists and answers as a model not pulled until `pull` fetched its target
    and its adapter's two files (hub adapters were never fetched, and never found in the
    cache, where the lookup asked for a model's config.json)."""
    c = ollama.Client(host=served.base_url, timeout=120)
    assert "hubsql:latest" not in names(served)
    with pytest.raises(ollama.ResponseError) as info:
        c.generate(model="hubsql", prompt=PROMPT, options=GREEDY, raw=True)
    assert info.value.status_code == 404
    c.pull("hubtiny")  # the target is here, loaded even, the adapter not: not pulled
    c.generate(model="hubtiny", prompt=PROMPT, options=GREEDY, raw=True)
    with pytest.raises(ollama.ResponseError) as info:  # it was a 500 from the scheduler
        c.generate(model="hubsql", prompt=PROMPT, options=GREEDY, raw=True)
    assert info.value.status_code == 404 and "try pulling it first" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        c.delete("hubsql")
    assert info.value.status_code == 404
    assert "hubsql:latest" not in names(served) and "hubtiny:latest" in names(served)
    statuses = [p.status for p in c.pull("hubsql", stream=True)]
    assert statuses[-1] == "success"
    found = resolve_adapter(ADAPTER_REPO)
    assert found is not None
    assert sorted(p.name for p in found.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
    ]
    assert {"hubsql:latest", "localsql:latest", "hubtiny:latest"} <= set(names(served))
    sql = c.generate(model="hubsql", prompt=PROMPT, options=GREEDY, raw=True).response
    assert sql == c.generate(model="localsql", prompt=PROMPT, options=GREEDY, raw=True).response
    assert sql != c.generate(model="hubtiny", prompt=PROMPT, options=GREEDY, raw=True).response

    shown = c.show("hubsql").modelfile or ""
    assert f"ADAPTER {found}" in shown  # where it was pulled to, as FROM names the base

    c.delete("hubsql")  # an entry of a file mlxd does not edit: its files go
    assert resolve_adapter(ADAPTER_REPO) is None
    assert not hub_env.storage(ADAPTER_REPO).exists()
    assert "hubsql:latest" not in names(served)
    assert "hubtiny:latest" in names(served)  # the target another entry uses stays


def test_pulling_an_adapter_repository_as_a_model_says_what_it_is(
    served: RunningServer,
) -> None:
    r = httpx.post(f"{served.base_url}/api/pull", json={"model": ADAPTER_REPO}, timeout=60)
    assert r.status_code == 200  # Ollama streams a pull's error after its first status
    last = r.text.strip().splitlines()[-1]
    assert "is a LoRA adapter, not a model" in last and "adapters:" in last
    body = {"model": ADAPTER_REPO, "stream": False}
    r = httpx.post(f"{served.base_url}/api/pull", json=body, timeout=60)
    assert r.status_code == 400 and "not a model" in r.json()["error"]  # it was a 500


def test_an_adapter_pinned_by_its_snapshot_path_is_pulled_then_served(
    served: RunningServer, hub_env: HubEnv, adapter: Path, tmp_path: Path
) -> None:
    """A path into the hub cache's snapshots is that repo at that commit: the entry is a model
    not pulled until a pull brings it, then served at once (it stayed unavailable)."""
    c = ollama.Client(host=served.base_url, timeout=120)
    c.pull("hubtiny")  # the base is here: only the adapter is not
    commit = hub_env.hub.add_repo(ADAPTER_REPO, adapter)  # the same files: the same commit
    snapshot = hub_env.storage(ADAPTER_REPO) / "snapshots" / commit
    registry = tmp_path / "base.yaml"
    text = registry.read_text(encoding="utf-8")
    registry.write_text(
        text + f"  pinned:\n    target: {TARGET_REPO}\n    adapters: [{snapshot}]\n", "utf-8"
    )

    def status() -> str:
        listed = httpx.get(f"{served.base_url}/api/mlxd/registry").json()["models"]
        return next((m["status"] for m in listed if m["name"] == "pinned:latest"), "")

    assert wait_for(lambda: status() != "")
    time.sleep(1)  # time for a probe, were one to start
    assert status().startswith("unavailable") and "pinned:latest" not in names(served)
    c.pull("pinned")
    assert wait_for(lambda: status() == "ok")
    sql = c.generate(model="pinned", prompt=PROMPT, options=GREEDY, raw=True).response
    assert sql == c.generate(model="localsql", prompt=PROMPT, options=GREEDY, raw=True).response


def test_an_entrys_hub_adapter_pulls_offline_from_the_cache_and_must_hold_its_files(
    served: RunningServer, hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, a pull of an entry whose adapter is cached succeeds from the cache; an
    adapter repository without `adapters.safetensors` is refused by name."""
    c = ollama.Client(host=served.base_url, timeout=120)
    c.pull("hubsql")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert [p.status for p in c.pull("hubsql", stream=True)][-1] == "success"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub_env.hub.add_repo(ADAPTER_REPO, {"adapter_config.json": b"{}"})  # a new main: no weights
    with pytest.raises(ollama.ResponseError) as info:
        c.pull("hubsql")
    assert "has no adapter files" in info.value.error and ADAPTER_REPO in info.value.error


def test_the_cli_says_which_adapter_a_pull_could_not_find(
    served: RunningServer, hub_env: HubEnv, tmp_path: Path
) -> None:
    registry = tmp_path / "base.yaml"
    text = registry.read_text(encoding="utf-8")
    registry.write_text(
        text + f"  nosuch:\n    target: {TARGET_REPO}\n    adapters: [org/nope-lora]\n", "utf-8"
    )
    assert wait_for(lambda: "nosuch:latest" in cli(["list"], served).stdout)
    result = cli(["pull", "nosuch"], served)
    assert result.returncode == 1
    assert "Error: pull model manifest: adapter org/nope-lora: file does not exist" in result.stderr
    assert "hint: an adapter the entry names is not there" in result.stderr
