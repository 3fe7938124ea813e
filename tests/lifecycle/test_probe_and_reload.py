"""Probe-open at startup and registry hot reload, through the running server."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerThread, wait_for
from tests.fixtures.tiny_models import TARGET_SHAPE, TinyPair, build_tokenizer, write_model


def tags(base: str) -> dict[str, dict]:
    return {m["name"]: m for m in httpx.get(f"{base}/api/tags").json()["models"]}


@pytest.fixture(scope="module")
def broken(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Pairings that must fail their probe, each for its own reason."""
    root = tmp_path_factory.mktemp("broken")
    other_tok = root / "other-tokenizer"
    build_tokenizer(other_tok, vocab_size=300)
    foreign = write_model(root / "foreign-draft", other_tok, **TARGET_SHAPE, seed=3)
    no_tokenizer = root / "no-tokenizer"
    shutil.copytree(tiny_pair.target, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    (no_tokenizer / "tokenizer_config.json").unlink()
    corrupt = root / "corrupt"
    shutil.copytree(tiny_pair.target, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {"foreign": foreign, "no_tokenizer": no_tokenizer, "corrupt": corrupt}


def test_broken_pairings_are_unavailable_and_others_serve(
    tiny_pair: TinyPair, broken: dict[str, Path], tmp_path: Path
) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(
        "models:\n"
        f"  good:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"  foreign:\n    target: {tiny_pair.target}\n    draft: {broken['foreign']}\n"
        f"  notok:\n    target: {broken['no_tokenizer']}\n"
        f"  corrupt:\n    target: {broken['corrupt']}\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as srv:
        # probes run in the background: wait until none is left
        assert wait_for(lambda: all("status" not in m for m in tags(srv.base_url).values()), 120)
        listed = tags(srv.base_url)
        assert "unavailable" not in listed["good:latest"]
        assert "tokenizer" in listed["foreign:latest"]["unavailable"]
        assert listed["notok:latest"]["unavailable"]
        assert listed["corrupt:latest"]["unavailable"]
        show = httpx.post(f"{srv.base_url}/api/show", json={"model": "foreign"}).json()
        assert "tokenizer" in show["unavailable"]
        for name in ("foreign", "notok", "corrupt"):
            r = httpx.post(
                f"{srv.base_url}/api/generate",
                json={"model": name, "prompt": "hi", "stream": True, "options": {"num_predict": 4}},
            )
            assert r.status_code == 500
            assert f"model '{name}:latest' is unavailable" in r.json()["error"]
        ok = httpx.post(
            f"{srv.base_url}/api/generate",
            json={"model": "good", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["done"]


def test_a_model_whose_files_are_repaired_serves_without_a_restart(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """A failed probe stands while the files are as they were; a pull that repairs them (here
    the good weights put back) is served on the next request."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pair.target, model)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  fixed:\n    target: {model}\n", encoding="utf-8")
    body = {"model": "fixed", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    with ServerThread(registry) as srv:
        for _ in range(2):
            r = httpx.post(f"{srv.base_url}/api/generate", json=body, timeout=60)
            assert r.status_code == 500 and "unavailable" in r.json()["error"]
        weights.write_bytes(good)
        r = httpx.post(f"{srv.base_url}/api/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["done"], r.text
        assert "unavailable" not in tags(srv.base_url)["fixed:latest"]


def test_hot_reload_add_change_remove_and_invalid(
    tiny_pair: TinyPair, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  first:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    with ServerThread(registry) as srv:
        base = srv.base_url
        assert set(tags(base)) == {"first:latest"}

        # add
        registry.write_text(
            "models:\n"
            f"  first:\n    target: {tiny_pair.target}\n"
            f"  second:\n    target: {tiny_pair.target}\n    system: Be brief.\n",
            encoding="utf-8",
        )
        assert wait_for(lambda: "second:latest" in tags(base))

        # change: the new options take effect without a restart
        def num_predict_is(n: int) -> bool:
            r = httpx.post(
                f"{base}/api/generate",
                json={"model": "second", "prompt": "hi", "stream": False},
                timeout=60,
            ).json()
            return r.get("eval_count") == n

        registry.write_text(
            "models:\n"
            f"  first:\n    target: {tiny_pair.target}\n"
            f"  second:\n    target: {tiny_pair.target}\n    options:\n      num_predict: 3\n",
            encoding="utf-8",
        )
        assert wait_for(lambda: num_predict_is(3))

        # invalid YAML: the last good registry keeps serving and the error names file and line
        with caplog.at_level(logging.ERROR):
            registry.write_text("models:\n  first:\n    target: [unclosed\n", encoding="utf-8")
            assert wait_for(
                lambda: any("registry reload failed" in r.message for r in caplog.records)
            )
        message = next(r.message for r in caplog.records if "registry reload failed" in r.message)
        assert re.search(r"models\.yaml:\d+: invalid YAML", message)
        assert set(tags(base)) == {"first:latest", "second:latest"}

        # remove
        registry.write_text(
            f"models:\n  second:\n    target: {tiny_pair.target}\n", encoding="utf-8"
        )
        assert wait_for(lambda: set(tags(base)) == {"second:latest"})
        r = httpx.post(f"{base}/api/generate", json={"model": "first", "prompt": "x"})
        assert r.status_code == 404


def test_an_edit_of_what_only_describes_an_entry_leaves_it_loaded() -> None:
    """A copy onto its own name writes a new time (Ollama's copy only writes a manifest): the
    loaded pairing stays; an edit of what it serves (its system prompt) is still stale."""
    from dataclasses import replace

    from mlxd.daemon.lifecycle import changed_entries
    from mlxd.registry.registry import Registry
    from mlxd.registry.schema import ModelEntry

    entry = ModelEntry("m", "org/repo", system="be brief")
    described = replace(entry, modified_at="2026-12-05T10:00:00Z", description="a copy")
    assert changed_entries(Registry([entry]), Registry([described]))[0] == []
    assert changed_entries(Registry([entry]), Registry([replace(entry, system="x")]))[0] == [
        entry.name
    ]
