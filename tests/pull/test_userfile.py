"""Editing $MLXD_HOME/models.yaml: atomic, locked, and leaving the rest of the file alone."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from mlxd.registry.schema import ModelEntry, RegistryError, load_registry_file
from mlxd.registry.userfile import NEW_FILE_HEADER, entry_fields, remove_entry, set_entry

HAND_WRITTEN = """\
# my models
version: 1
models:
  # the coder I use at work
  coder:
    target: org/coder   # 4-bit
    options:
      stop: ["<|im_end|>"]
  chat:
    target: org/chat
    system: |
      You are helpful.
      # this line is part of the prompt
# end of file
"""


def names(path: Path) -> list[str]:
    return [e.name for e in load_registry_file(path).values()]


def test_creates_the_file_with_version_1(tmp_path: Path) -> None:
    path = tmp_path / "home" / "models.yaml"
    set_entry("hf.co/org/tiny:latest", {"target": "org/tiny"}, path=path)
    text = path.read_text()
    assert text.startswith(NEW_FILE_HEADER)
    assert "version: 1\n" in text
    (entry,) = load_registry_file(path).values()
    assert (entry.name, entry.target) == ("hf.co/org/tiny:latest", "org/tiny")


def test_edits_keep_comments_and_other_entries(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(HAND_WRITTEN)
    set_entry("new:latest", {"target": "org/new", "options": {"stop": ("a", "b")}}, path=path)
    assert names(path) == ["coder:latest", "chat:latest", "new:latest"]
    assert path.read_text().startswith(HAND_WRITTEN.removesuffix("# end of file\n"))
    assert path.read_text().endswith("# end of file\n")
    assert load_registry_file(path)["new:latest"].options["stop"] == ("a", "b")

    set_entry("CODER", {"target": "org/coder-v2"}, path=path)  # replaced where it stands
    entries = load_registry_file(path)
    assert list(entries) == ["coder:latest", "chat:latest", "new:latest"]
    assert entries["coder:latest"].target == "org/coder-v2"
    assert "# the coder I use at work" in path.read_text()

    assert remove_entry("chat", path=path) is True
    assert names(path) == ["CODER:latest", "new:latest"]  # spelled as last written
    text = path.read_text()
    assert "# my models" in text and "# end of file" in text and "version: 1" in text
    assert remove_entry("chat", path=path) is False


def test_edits_keep_the_layout_around_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "version: 1\nmodels:\n"
        "  a:\n    target: org/a\n    system: |\n      one\n      two\n\n"
        "  # about b\n  b:\n    target: org/b\n"
        "  # about c\n  c:\n    target: org/c\n"
    )
    set_entry("a", {"target": "org/a2", "system": "three\nfour\n"}, path=path)
    text = path.read_text()
    assert "    system: |\n      three\n      four\n\n  # about b\n" in text  # blank line kept
    assert remove_entry("b", path=path)
    text = path.read_text()
    assert "about b" not in text and "  # about c\n  c:\n" in text  # its comment went with it
    assert load_registry_file(path)["a:latest"].system == "three\nfour\n"


def test_flow_style_models_are_rewritten_without_losing_data(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("version: 1\nmodels: {a: {target: org/a}, b: {target: org/b}}\n")
    set_entry("c", {"target": "org/c"}, path=path)
    assert names(path) == ["a:latest", "b:latest", "c:latest"]
    assert remove_entry("a", path=path)
    assert names(path) == ["b:latest", "c:latest"]


def test_an_invalid_file_is_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    broken = "version: 1\nmodels:\n  x:\n    target: org/x\n    draft_tokens: many\n"
    path.write_text(broken)
    with pytest.raises(RegistryError, match="draft_tokens"):
        set_entry("y", {"target": "org/y"}, path=path)
    assert path.read_text() == broken
    assert not list(tmp_path.glob(".models.yaml.*.tmp"))


def test_entry_fields_round_trip(tmp_path: Path) -> None:
    entry = ModelEntry(
        name="src",
        target="/models/x",
        draft="org/draft",
        draft_tokens=3,
        options={"stop": ("<a>",), "temperature": 0.2},
        system="Be brief.",
        context_length=4096,
    )
    path = tmp_path / "models.yaml"
    set_entry("dst", entry_fields(entry), path=path)
    copy = load_registry_file(path)["dst:latest"]
    for key in ("target", "draft", "draft_tokens", "system", "context_length"):
        assert getattr(copy, key) == getattr(entry, key), key
    assert dict(copy.options) == dict(entry.options)


def test_threads_do_not_clobber_each_other(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    threads = [
        threading.Thread(
            target=set_entry, args=(f"m{i}", {"target": f"org/m{i}"}), kwargs={"path": path}
        )
        for i in range(12)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(names(path)) == sorted(f"m{i}:latest" for i in range(12))


def _writer(path: str, prefix: str, count: int) -> None:
    for i in range(count):
        set_entry(f"{prefix}{i}", {"target": f"org/{prefix}{i}"}, path=Path(path))


def test_processes_do_not_clobber_each_other(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), f"p{n}x", 5)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(names(path)) == 15
