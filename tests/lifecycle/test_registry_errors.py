"""Registry edits the server cannot use are visible through the API, and a half-saved file
never takes every model away: the real watcher, a real server, real files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerThread, wait_for
from tests.fixtures.tiny_models import TinyPair


def stats(base: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{base}/api/mlxd/stats", timeout=30).json()
    return out


def tags(base: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{base}/api/tags", timeout=30).json()
    return out


def test_a_half_saved_registry_keeps_the_last_good_one(tiny_pair: TinyPair, tmp_path: Path) -> None:
    registry = tmp_path / "models.yaml"
    good = f"models:\n  first:\n    target: {tiny_pair.target}\n"
    registry.write_text(good, encoding="utf-8")
    with ServerThread(registry) as srv:
        base = srv.base_url
        assert stats(base)["registry_errors"] == []
        assert "warning" not in tags(base)

        registry.write_text("", encoding="utf-8")  # truncated, the rest not written yet
        assert wait_for(lambda: bool(stats(base)["registry_errors"]))
        assert "empty" in stats(base)["registry_errors"][0]
        listed = tags(base)
        assert [m["name"] for m in listed["models"]] == ["first:latest"]
        assert "empty" in listed["warning"]
        r = httpx.post(
            f"{base}/api/generate",
            json={"model": "first", "prompt": "hi", "stream": False, "options": {"num_predict": 1}},
            timeout=60,
        )
        assert r.status_code == 200, r.text

        registry.write_text("models:\n  first:\n    target: [unclosed\n", encoding="utf-8")
        assert wait_for(lambda: "invalid YAML" in "".join(stats(base)["registry_errors"]))
        assert "models.yaml:" in stats(base)["registry_errors"][0]

        registry.write_text(good.replace("first", "second"), encoding="utf-8")  # saved at last
        assert wait_for(lambda: stats(base)["registry_errors"] == [])
        assert [m["name"] for m in tags(base)["models"]] == ["second:latest"]
        assert "warning" not in tags(base)


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{{ range .Messages }}{{ .Content }}{{ end }}", "range .Messages"),
        ("{% for m in messages %}{{ m.content }}", "Jinja syntax error on line 1"),
    ],
    ids=["go", "jinja"],
)
def test_a_template_mlxd_cannot_render_is_an_invalid_registry(
    tiny_pair: TinyPair, tmp_path: Path, template: str, named: str
) -> None:
    """As `/api/create` refuses it, rather than every chat on the model being refused."""
    registry = tmp_path / "models.yaml"
    good = f"models:\n  first:\n    target: {tiny_pair.target}\n"
    registry.write_text(good, encoding="utf-8")
    with ServerThread(registry) as srv:
        base = srv.base_url
        bad = good + f"    template: '{template}'\n"
        registry.write_text(bad, encoding="utf-8")
        assert wait_for(lambda: named in "".join(stats(base)["registry_errors"]))
        assert (
            "models.yaml:2: entry 'first:latest': key 'template'"
            in (stats(base)["registry_errors"][0])
        )
        r = httpx.post(f"{base}/api/chat", timeout=60, json={
            "model": "first", "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 1},
        })  # fmt: skip
        assert r.status_code == 200, r.text  # the last good registry serves


def test_a_registry_given_as_a_link_follows_the_link_when_it_is_repointed(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """As configuration managers deploy a file (a link swapped to a new release's folder): the
    new file is read, and its later edits are seen too."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    first, second = tmp_path / "v1" / "models.yaml", tmp_path / "v2" / "models.yaml"
    first.write_text(f"models:\n  first:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    second.write_text(f"models:\n  second:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    link = tmp_path / "current.yaml"
    link.symlink_to(first)

    def names(base: str) -> list[str]:
        return [m["name"] for m in tags(base)["models"]]

    with ServerThread(link) as srv:
        base = srv.base_url
        assert names(base) == ["first:latest"]
        swap = tmp_path / "swap.yaml"
        swap.symlink_to(second)
        swap.replace(link)  # repointed at once, as `ln -sfn` does
        assert wait_for(lambda: names(base) == ["second:latest"])
        second.write_text(
            f"models:\n  third:\n    target: {tiny_pair.target}\n", encoding="utf-8"
        )  # an edit of the file the link points to now
        assert wait_for(lambda: names(base) == ["third:latest"])
