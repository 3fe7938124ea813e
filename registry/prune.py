"""What a deleted model leaves unused under `MLXD_HOME`: the adapter directories `/api/create`
assembled for it (`<MLXD_HOME>/adapters/<digest>/`) and the uploaded blobs linked into them, as
Ollama prunes a deleted model's layers that no other model uses."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from mlxd.registry.blobs import blobs_dir
from mlxd.registry.home import mlxd_home
from mlxd.registry.schema import ModelEntry

__all__ = ["prune_adapters"]


def _adapter_dirs(entry: ModelEntry, root: Path) -> set[Path]:
    """The entry's adapter directories that lie in `root` (those create assembled)."""
    found = set()
    for ref in (*entry.adapters, *entry.draft_adapters):
        path = Path(ref.ref)
        if path.is_absolute() and path.resolve().parent == root:
            found.add(path.resolve())
    return found


def prune_adapters(
    gone: ModelEntry, others: Iterable[ModelEntry], env: Mapping[str, str] = os.environ
) -> int:
    """Remove `gone`'s assembled adapter directories that none of `others` uses, and the blobs
    only they linked (a blob whose file is also another directory's, or was copied, stays);
    the bytes freed."""
    root = (mlxd_home(env) / "adapters").resolve()
    used = set().union(*(_adapter_dirs(e, root) for e in others))
    doomed = [d for d in _adapter_dirs(gone, root) if d not in used and d.is_dir()]
    inodes: set[tuple[int, int]] = set()
    freed = 0
    for folder in doomed:
        for file in folder.iterdir():
            st = file.stat()
            inodes.add((st.st_dev, st.st_ino))
            freed += st.st_size if st.st_nlink == 1 else 0
        shutil.rmtree(folder, ignore_errors=True)
    blobs = blobs_dir(env)
    if inodes and blobs.is_dir():
        for blob in blobs.iterdir():
            st = blob.stat()
            if (st.st_dev, st.st_ino) in inodes and st.st_nlink == 1:  # linked nowhere else now
                blob.unlink(missing_ok=True)
                freed += st.st_size
    return freed
