"""Startup like Ollama's: the server answers at once, pairings are probed in the background
(`probing` in /api/tags and the registry listing), a request waits for its pairing's probe,
and a passed probe is remembered across restarts for the same files, backend and MLX."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from mlxd.engine.backend import configure_backend
from mlxd.engine.probestore import ProbeStore
from mlxd.registry.schema import ModelEntry
from tests.conftest import ServerThread, wait_for
from tests.fixtures.tiny_models import TinyPair

NAMES = ("a", "b", "c", "d")


def registry(tmp: Path, pair: TinyPair) -> Path:
    path = tmp / "models.yaml"
    path.write_text(
        "models:\n"
        + "".join(f"  {n}:\n    target: {pair.target}\n    draft: {pair.draft}\n" for n in NAMES),
        encoding="utf-8",
    )
    return path


def status(base: str) -> dict[str, str | None]:
    models = httpx.get(f"{base}/api/tags", timeout=30).json()["models"]
    return {m["name"]: m.get("status") for m in models}


def test_serve_answers_while_pairings_are_probed_and_remembers_them(
    tiny_pair: TinyPair,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))  # nothing probed before
    path = registry(tmp_path, tiny_pair)
    with ServerThread(path) as srv:
        base = srv.base_url
        # four pairings take seconds each to check and measure; the server answers already
        first = status(base)
        assert first["d:latest"] == "probing"
        listing = httpx.get(f"{base}/api/mlxd/registry", timeout=30).json()["models"]
        assert {m["name"]: m["status"] for m in listing}["d:latest"] == "probing"
        # a request for the last one waits for its probe (which goes next) and is answered
        r = httpx.post(
            f"{base}/api/generate",
            json={"model": "d", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        assert status(base)["d:latest"] is None
        assert wait_for(lambda: not any(status(base).values()), 300)
    stored = list((tmp_path / "home" / "probes").glob("*.json"))
    assert len(stored) == 1  # four names, one pairing of the same files

    thread = ServerThread(path)
    with caplog.at_level(logging.INFO, logger="mlxd.engine.manager"), thread as srv:
        assert wait_for(lambda: not any(status(srv.base_url).values()), 60)
        results = [thread.state.manager.probe_result(e) for e in thread.state.registry()]
    assert all(r is not None and r.ok and r.remembered for r in results)
    assert any("unchanged since it was last probed" in r.getMessage() for r in caplog.records)


def test_the_key_follows_the_files_and_the_backend(tiny_pair: TinyPair, tmp_path: Path) -> None:
    store = ProbeStore(tmp_path)
    backend = configure_backend()
    pair = ModelEntry("p", str(tiny_pair.target), str(tiny_pair.draft))
    solo = ModelEntry("s", str(tiny_pair.target))
    key = store.key(pair, backend)
    assert key is not None and key == store.key(ModelEntry("q", pair.target, pair.draft), backend)
    assert key != store.key(solo, backend)
    other = type(backend)(**{**backend.__dict__, "float32_compute": not backend.float32_compute})
    assert key != store.key(pair, other)
    assert store.key(ModelEntry("m", "org/not-pulled"), backend) is None


def test_stored_costs_read_back_equal(tmp_path: Path) -> None:
    from mlxd.engine.speculation import Costs

    store = ProbeStore(tmp_path / "probes")
    costs = Costs(verify={1: 0.01, 4: 0.02}, draft_step=0.003, plain_step=0.011)
    store.save("k", costs)
    assert store.load("k") == costs
    assert store.load("missing") is None
    (tmp_path / "probes" / "bad.json").write_text("{not json")
    assert store.load("bad") is None
