"""The live registry: a half-saved file never replaces the last good registry."""

from __future__ import annotations

from pathlib import Path

from mlxd.registry.live import LiveRegistry
from mlxd.registry.registry import Registry

GOOD = "models:\n  coder: {target: org/coder}\n  chat: {target: org/chat}\n"


def live_over(path: Path) -> LiveRegistry:
    return LiveRegistry(lambda: Registry.load([path], optional=()))


def names(live: LiveRegistry) -> set[str]:
    return {e.name for e in live().entries()}


def test_an_empty_file_is_not_yet_written(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(GOOD, encoding="utf-8")
    live = live_over(path)
    path.write_text("", encoding="utf-8")  # an editor truncated it and has not written yet
    error = live.reload()
    assert error is not None and "empty" in str(error)
    assert names(live) == {"coder:latest", "chat:latest"}
    assert live.errors() == [str(error)]
    path.write_text(GOOD.replace("chat", "talk"), encoding="utf-8")  # the save ends
    assert live.reload() is None
    assert names(live) == {"coder:latest", "talk:latest"}
    assert live.errors() == []


def test_an_empty_file_that_changes_nothing_is_fine(tmp_path: Path) -> None:
    """A skeleton file that was empty already is still valid and empty."""
    path = tmp_path / "models.yaml"
    path.write_text("", encoding="utf-8")
    live = live_over(path)
    assert len(live()) == 0
    assert live.reload() is None and live.errors() == []


def test_emptying_on_purpose_takes_an_explicit_file(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(GOOD, encoding="utf-8")
    live = live_over(path)
    path.write_text("models: {}\n", encoding="utf-8")
    assert live.reload() is None
    assert len(live()) == 0


def test_invalid_edits_are_reported_until_fixed(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(GOOD, encoding="utf-8")
    live = live_over(path)
    path.write_text("models:\n  coder: {target: [unclosed\n", encoding="utf-8")
    assert live.reload() is not None
    assert names(live) == {"coder:latest", "chat:latest"}
    [message] = live.errors()
    assert "models.yaml:" in message and "invalid YAML" in message
    path.write_text(GOOD, encoding="utf-8")
    assert live.reload() is None and live.errors() == []


def rewriting_loader(path: Path, rewrites: int) -> tuple[LiveRegistry, list[int]]:
    """A live registry whose next `rewrites` reads each see another writer replace the file
    while they read it (as concurrent creates do)."""
    reads = [0]

    def load() -> Registry:
        fresh = Registry.load([path], optional=())
        reads[0] += 1
        if 1 < reads[0] <= rewrites + 1:  # not the first load, at construction
            path.write_text(GOOD + f"  extra{reads[0]}: {{target: org/x{'x' * reads[0]}}}\n")
        return fresh

    return LiveRegistry(load), reads


def test_a_file_replaced_while_read_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(GOOD, encoding="utf-8")
    live, reads = rewriting_loader(path, rewrites=2)
    assert live.reload() is None
    assert reads[0] == 4  # construction, two reads overtaken, one clean
    assert "extra3:latest" in names(live)  # what the last writer wrote


def test_a_file_that_never_settles_keeps_the_last_good(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(GOOD, encoding="utf-8")
    live, _ = rewriting_loader(path, rewrites=100)
    error = live.reload()
    assert error is not None and "changed while being read" in str(error)
    assert names(live) == {"coder:latest", "chat:latest"}
