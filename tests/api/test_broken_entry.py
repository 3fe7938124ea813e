"""A registry entry whose directory holds no model breaks only itself.

The listing routes read every entry's files; one directory that is not a model (a typo in
models.yaml, a half-deleted download) must not turn /api/tags, /v1/models or /api/show into
500s for every other model. Real uvicorn, real httpx.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ServerThread, wait_for
from tests.fixtures.tiny_models import TinyPair


@pytest.fixture(scope="module")
def base_url(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("broken-entry")
    notes = root / "notes"  # a directory, but not a model: no config, no weights
    notes.mkdir()
    (notes / "README.md").write_text("not a model\n", encoding="utf-8")
    garbled = root / "garbled"  # model-looking files that cannot be read
    garbled.mkdir()
    (garbled / "config.json").write_text("{not json", encoding="utf-8")
    (garbled / "model.safetensors").write_bytes(b"\x00\x01garbage")
    misfit = root / "misfit"  # readable files that do not load: more layers than weights
    shutil.copytree(tiny_pair.target, misfit)
    config = json.loads((misfit / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] += 1
    (misfit / "config.json").write_text(json.dumps(config), encoding="utf-8")
    registry = root / "models.yaml"
    registry.write_text(
        "models:\n"
        f"  tiny:\n    target: {tiny_pair.target}\n"
        f"  misfit:\n    target: {misfit}\n"
        f"  notes:\n    target: {notes}\n"
        f"  garbled:\n    target: {garbled}\n"
        f"  halfpair:\n    target: {tiny_pair.target}\n    draft: {notes}\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info.base_url


BROKEN = ("notes", "garbled", "halfpair")


def test_tags_lists_every_model_and_marks_the_broken_ones(base_url: str) -> None:
    r = httpx.get(f"{base_url}/api/tags", timeout=60)
    assert r.status_code == 200, r.text
    models = {m["name"].split(":")[0]: m for m in r.json()["models"]}
    assert set(models) == {"tiny", "misfit", *BROKEN}
    assert "unavailable" not in models["tiny"]
    assert models["tiny"]["details"]["family"]
    for name in BROKEN:
        assert models[name]["unavailable"], name
    digests = [m["digest"] for m in models.values()]  # `ollama ls` cuts each to 12 characters
    assert all(len(d) == 64 for d in digests) and len(set(digests)) == len(digests)


def test_openai_models_still_answers(base_url: str) -> None:
    r = httpx.get(f"{base_url}/v1/models", timeout=60)
    assert r.status_code == 200, r.text
    ids = {m["id"].split(":")[0] for m in r.json()["data"]}
    assert "tiny" in ids


def test_openai_models_lists_only_what_serves(base_url: str) -> None:
    """A model whose files read but do not load (its probe failed) is not offered to OpenAI
    clients, whose list has no field to say why."""

    def unavailable() -> bool:
        tags = httpx.get(f"{base_url}/api/tags", timeout=60).json()["models"]
        return any(m["name"] == "misfit:latest" and m.get("unavailable") for m in tags)

    assert wait_for(unavailable, 120)
    ids = {m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"]}
    assert "misfit:latest" not in ids and "tiny:latest" in ids


def test_show_fails_for_the_broken_entry_only(base_url: str) -> None:
    ok = httpx.post(f"{base_url}/api/show", json={"model": "tiny"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["details"]["family"]
    for name in BROKEN:
        r = httpx.post(f"{base_url}/api/show", json={"model": name}, timeout=60)
        assert r.status_code == 500, r.text
        body = r.json()
        assert set(body) == {"error"}
        assert f"'{name}" in body["error"] and "unavailable" in body["error"], body
    gone = httpx.get(f"{base_url}/v1/models/notes", timeout=60)
    assert gone.status_code != 200 and "error" in gone.json()


def test_the_good_model_still_generates(base_url: str) -> None:
    r = httpx.post(
        f"{base_url}/api/generate",
        json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    bad = httpx.post(
        f"{base_url}/api/generate",
        json={"model": "notes", "prompt": "hi", "stream": False},
        timeout=120,
    )
    assert bad.status_code in (404, 500) and "error" in bad.json(), bad.text
