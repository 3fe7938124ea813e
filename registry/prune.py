"""What a deleted model leaves unused under `MLXD_HOME`: the adapter directories `/api/create`
assembled for it (`<MLXD_HOME>/adapters/<digest>/`) and the uploaded blobs linked into them, as
Ollama prunes a deleted model's layers that no other model uses."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from mlxd.registry.blobs import blobs_dir
from mlxd.registry.home import mlxd_home, user_registry_path
from mlxd.registry.names import parse_name
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry, RegistryError
from mlxd.registry.userfile import file_lock

__all__ = ["adapters_dir", "adapters_lock", "prune_adapters", "prune_replaced", "stored_entry"]

_ASSEMBLED = re.compile(r"[0-9a-f]{64}")  # the digest create names a directory it assembles


def adapters_dir(env: Mapping[str, str] = os.environ) -> Path:
    return mlxd_home(env) / "adapters"


@contextlib.contextmanager
def adapters_lock(env: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Held by a create from assembling its adapter directory until its entry is written, and
    by a delete while it decides what to prune: a delete never removes a directory a create
    is registering."""
    with file_lock(mlxd_home(env) / ".adapters.lock"):
        yield


def _assembled(entry: ModelEntry, root: Path) -> set[Path]:
    """The entry's adapter directories that create assembled (digest-named, in `root`); a
    folder of the user's own, wherever it is, is never one of them."""
    found = set()
    for ref in (*entry.adapters, *entry.draft_adapters):
        path = Path(ref.ref)
        # resolved: a digest-named link to a folder elsewhere is not one
        if path.is_absolute() and _ASSEMBLED.fullmatch(path.name) and path.resolve().parent == root:
            found.add(path.resolve())
    return found


def prune_adapters(
    gone: ModelEntry, others: Iterable[ModelEntry], env: Mapping[str, str] = os.environ
) -> int:
    """Remove `gone`'s assembled adapter directories that none of `others` uses, and the blobs
    only they linked (a blob also linked elsewhere, or copied, stays); the bytes freed. Call it
    holding `adapters_lock`, `others` read under it. What cannot be removed is left."""
    root = adapters_dir(env).resolve()
    used = set().union(*(_assembled(e, root) for e in others))
    inodes: set[tuple[int, int]] = set()
    freed = 0
    for folder in _assembled(gone, root) - used:
        with contextlib.suppress(OSError):
            for file in folder.iterdir():
                st = file.lstat()
                if stat.S_ISREG(st.st_mode):
                    inodes.add((st.st_dev, st.st_ino))
                    freed += st.st_size if st.st_nlink == 1 else 0
            shutil.rmtree(folder, ignore_errors=True)
    blobs = blobs_dir(env)
    if not inodes:
        return freed
    with contextlib.suppress(OSError):
        for blob in blobs.iterdir():
            st = blob.lstat()
            if (st.st_dev, st.st_ino) in inodes and st.st_nlink == 1:  # linked nowhere else now
                blob.unlink(missing_ok=True)
                freed += st.st_size
    return freed


def prune_replaced(
    replaced: ModelEntry, registry: Registry, env: Mapping[str, str] = os.environ
) -> int:
    """After a create or copy wrote over `replaced`: where it was an entry of the user
    registry, its assembled adapter directories that no model uses now, as Ollama removes a
    replaced manifest's unused layers; the bytes freed. Call it holding `adapters_lock`."""
    user_file = user_registry_path(env)
    if os.path.realpath(replaced.source) != os.path.realpath(user_file):
        return 0
    try:
        now = Registry.load(list(registry.paths), optional=(user_file,))
    except (RegistryError, OSError):
        return 0  # left for a later delete
    return prune_adapters(replaced, now.entries(), env)


def stored_entry(
    name: str, registry: Registry, env: Mapping[str, str] = os.environ
) -> ModelEntry | None:
    """The entry a create or copy to `name` writes over: the one of that name, whatever its
    case, as the registry files hold it now (read under `adapters_lock`, so two creates of
    one name each see what the other wrote). A hub model `hf.co/org/x`, which `org/x` finds
    for a pull or a run, is another model here."""
    try:
        now = Registry.load(list(registry.paths), optional=(user_registry_path(env),))
    except (RegistryError, OSError):
        now = registry
    found = now.get(name)
    if found is None or parse_name(found.name).key != parse_name(name).key:
        return None
    return found
