"""Pruning a deleted model's adapter files: only what create assembled, only what no other
model uses, and never a failure halfway."""

from __future__ import annotations

import os
from pathlib import Path

from mlxd.registry.prune import prune_adapters
from mlxd.registry.schema import AdapterRef, ModelEntry

DIGEST = "ab" * 32


def entry(name: str, *folders: Path) -> ModelEntry:
    return ModelEntry(name, "/base", adapters=tuple(AdapterRef(str(f)) for f in folders))


def assembled(home: Path, name: str, content: bytes) -> tuple[Path, Path]:
    """A folder as create assembles it: its file a hard link to an uploaded blob."""
    blob = home / "blobs" / f"sha256-{name}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(content)
    folder = home / "adapters" / (name * 64)[:64]
    folder.mkdir(parents=True)
    os.link(blob, folder / "adapters.safetensors")
    return folder, blob


def test_only_what_create_assembled_and_nobody_else_uses_is_removed(tmp_path: Path) -> None:
    env = {"MLXD_HOME": str(tmp_path)}
    mine = tmp_path / "adapters" / "my-lora"  # the user's own folder, kept under MLXD_HOME
    mine.mkdir(parents=True)
    (mine / "adapters.safetensors").write_bytes(b"own")
    shared, shared_blob = assembled(tmp_path, "a", b"x" * 10)
    alone, alone_blob = assembled(tmp_path, "b", b"y" * 20)
    gone = entry("gone", mine, shared, alone)
    freed = prune_adapters(gone, [entry("other", shared)], env)
    assert mine.is_dir() and (mine / "adapters.safetensors").is_file()
    assert shared.is_dir() and shared_blob.is_file()  # another model is on it
    assert not alone.exists() and not alone_blob.exists() and freed == 20


def test_a_dangling_link_or_a_folder_gone_meanwhile_fails_nothing(tmp_path: Path) -> None:
    env = {"MLXD_HOME": str(tmp_path)}
    folder, blob = assembled(tmp_path, "c", b"z")
    (folder / "stale").symlink_to(tmp_path / "nowhere")
    missing = tmp_path / "adapters" / DIGEST  # named, but already removed
    assert prune_adapters(entry("gone", folder, missing), [], env) == 1
    assert not folder.exists() and not blob.exists()
