"""Merging registry files and choosing which files to load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxd.registry import home
from mlxd.registry.home import ensure_home, mlxd_home, packaged_registry_path, user_registry_path
from mlxd.registry.names import InvalidModelName
from mlxd.registry.registry import Registry, default_registry_paths
from mlxd.registry.schema import ModelEntry, RegistryError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, Path]:
    base = write(
        tmp_path / "base.yaml",
        "models:\n"
        "  coder:7b: {target: org/coder, draft: org/small, draft_tokens: 3}\n"
        "  Chat: {target: org/chat}\n",
    )
    user = write(
        tmp_path / "user" / "models.yaml",
        "models:\n  CODER:7B: {target: org/coder-8bit}\n  mine/extra:v1: {target: ./local}\n",
    )
    return base, user


def test_later_files_override_by_name(two_files: tuple[Path, Path]) -> None:
    base, user = two_files
    reg = Registry.load([base, user])
    assert [e.name for e in reg.entries()] == ["CODER:7B", "Chat:latest", "mine/extra:v1"]
    coder = reg.get("coder:7b")
    assert coder is not None
    # The whole entry is replaced, not merged field by field.
    assert coder.target == "org/coder-8bit" and coder.draft is None
    assert coder.source == user.absolute()
    assert reg.paths == (base, user)
    assert len(reg) == 3


def test_get_is_case_insensitive_and_applies_defaults(two_files: tuple[Path, Path]) -> None:
    reg = Registry.load(list(two_files))
    chat = reg.get("chat")
    assert chat is not None and chat.name == "Chat:latest"
    assert reg.get("CHAT:latest") is chat
    assert reg.get("registry.ollama.ai/library/chat:latest") is chat
    assert reg.get("Mine/Extra:V1") is not None
    assert reg.get("mine/extra") is None  # tag defaults to latest
    assert reg.get("nothing") is None
    assert "chat" in reg and "nothing" not in reg and "bad name" not in reg


def test_get_rejects_invalid_names() -> None:
    with pytest.raises(InvalidModelName):
        Registry().get("bad name")


def test_missing_optional_user_file_is_skipped(
    tmp_path: Path, two_files: tuple[Path, Path]
) -> None:
    base, _ = two_files
    absent = tmp_path / "nowhere" / "models.yaml"
    reg = Registry.load([base, absent], optional=[absent])
    assert len(reg) == 2
    assert reg.paths == (base, absent)  # still listed, so a watcher can pick it up later


def test_missing_required_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="cannot read registry file"):
        Registry.load([tmp_path / "absent.yaml"], optional=[])


def test_default_optional_is_the_user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))
    assert len(Registry.load([tmp_path / "home" / "models.yaml"])) == 0


def test_errors_propagate_from_any_file(two_files: tuple[Path, Path], tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "models:\n  x: {target: a/b, draft_tokens: no}\n")
    with pytest.raises(RegistryError, match=r"bad\.yaml:2: entry 'x': key 'draft_tokens'"):
        Registry.load([*two_files, bad])


def test_registry_from_entries() -> None:
    reg = Registry([ModelEntry(name="a", target="/x"), ModelEntry(name="A:latest", target="/y")])
    assert [e.target for e in reg] == ["/y"]
    assert "Registry(1 models" in repr(reg)


def test_default_paths_cli_wins(tmp_path: Path) -> None:
    env = {"MLXD_REGISTRY": str(tmp_path / "env.yaml"), "MLXD_HOME": str(tmp_path)}
    assert default_registry_paths(env, tmp_path / "cli.yaml") == [tmp_path / "cli.yaml"]


def test_default_paths_env(tmp_path: Path) -> None:
    env = {"MLXD_REGISTRY": str(tmp_path / "env.yaml"), "MLXD_HOME": str(tmp_path)}
    assert default_registry_paths(env) == [tmp_path / "env.yaml"]
    env["MLXD_REGISTRY"] = os.pathsep.join([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")])
    assert default_registry_paths(env) == [tmp_path / "a.yaml", tmp_path / "b.yaml"]


def test_default_paths_packaged_then_user(tmp_path: Path) -> None:
    env = {"MLXD_HOME": str(tmp_path / "h"), "MLXD_REGISTRY": ""}
    paths = default_registry_paths(env)
    packaged = packaged_registry_path()
    assert packaged is not None  # this checkout ships models.yaml at the project root
    assert paths == [packaged, tmp_path / "h" / "models.yaml"]


def test_default_paths_without_packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mlxd.registry.registry.packaged_registry_path", lambda: None)
    assert default_registry_paths({"MLXD_HOME": str(tmp_path)}) == [tmp_path / "models.yaml"]


def test_from_env_user_overrides_packaged(tmp_path: Path) -> None:
    env = {"MLXD_HOME": str(tmp_path)}
    reg = Registry.from_env(env)
    assert reg.get("qwen2.5:7b") is not None  # from the packaged file; user file absent
    write(tmp_path / "models.yaml", "models:\n  qwen2.5:7b: {target: me/q}\n")
    entry = Registry.from_env(env).get("qwen2.5:7b")
    assert entry is not None and entry.target == "me/q"


def test_home(tmp_path: Path) -> None:
    env = {"MLXD_HOME": str(tmp_path / "h")}
    assert mlxd_home(env) == tmp_path / "h"
    assert not (tmp_path / "h").exists()
    assert ensure_home(env) == tmp_path / "h" and (tmp_path / "h").is_dir()
    assert user_registry_path(env) == tmp_path / "h" / "models.yaml"
    assert mlxd_home({}) == Path.home() / ".mlxd"
    assert mlxd_home({"MLXD_HOME": "~/x"}) == Path.home() / "x"


def test_packaged_path_falls_back_to_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pkg = tmp_path / "site" / "registry" / "home.py"
    monkeypatch.setattr(home, "__file__", str(fake_pkg))
    monkeypatch.setattr(home.sys, "prefix", str(tmp_path / "prefix"))
    assert packaged_registry_path() is None
    shared = write(tmp_path / "prefix" / "share" / "mlxd" / "models.yaml", "models:\n")
    assert packaged_registry_path() == shared
