"""The merged registry: every configured model name, looked up the way Ollama matches names."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from mlxd.registry.home import packaged_registry_path, user_registry_path
from mlxd.registry.names import hub_name, parse_name
from mlxd.registry.schema import ModelEntry, load_registry_file

__all__ = ["REGISTRY_ENV", "Registry", "default_registry_paths"]

REGISTRY_ENV = "MLXD_REGISTRY"


def _norm(path: Path) -> Path:
    return Path(path).expanduser().absolute()


class Registry:
    """Model entries merged from one or more registry files, later files winning by name.

    Immutable once built: reloading (e.g. on a file change) builds a new Registry, so a
    request that already looked a model up never sees a half-applied edit.
    """

    __slots__ = ("_entries", "_paths")

    def __init__(self, entries: Iterable[ModelEntry] = (), paths: Sequence[Path] = ()) -> None:
        merged: dict[str, ModelEntry] = {}
        for entry in entries:
            merged[entry.key] = entry
        self._entries: Mapping[str, ModelEntry] = merged
        self._paths: tuple[Path, ...] = tuple(paths)

    @classmethod
    def load(cls, paths: Sequence[Path], *, optional: Collection[Path] | None = None) -> Registry:
        """Load ``paths`` in order; an entry in a later file replaces the same name before it.

        A missing file listed in ``optional`` is skipped (default: the user's
        ``<MLXD_HOME>/models.yaml``, which need not exist); any other missing or invalid
        file raises :class:`~registry.schema.RegistryError`.
        """
        if optional is None:
            optional = (user_registry_path(os.environ),)
        skippable = {_norm(p) for p in optional}
        merged: dict[str, ModelEntry] = {}
        for path in paths:
            if _norm(path) in skippable and not Path(path).expanduser().exists():
                continue
            merged.update(load_registry_file(path))
        return cls(merged.values(), paths)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] = os.environ, cli_path: Path | None = None
    ) -> Registry:
        """Load the registry files :func:`default_registry_paths` picks for ``env``."""
        return cls.load(default_registry_paths(env, cli_path), optional=(user_registry_path(env),))

    @property
    def paths(self) -> tuple[Path, ...]:
        """The files this registry was loaded from, including skipped optional ones (to watch)."""
        return self._paths

    def get(self, name: str) -> ModelEntry | None:
        """The entry for an Ollama name, matched case-insensitively; raises InvalidModelName.
        `org/repo` not registered as such is the hub repo a pull of it registered
        (`hf.co/org/repo:tag`), so every command takes the name it was pulled by."""
        parsed = parse_name(name)
        entry = self._entries.get(parsed.key)
        hub = hub_name(parsed) if entry is None else None
        return self._entries.get(hub.key) if hub is not None else entry

    def entries(self) -> list[ModelEntry]:
        """All entries, in load order (an overridden name keeps its first position)."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ModelEntry]:
        return iter(self.entries())

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            return self.get(name) is not None
        except ValueError:
            return False

    def __repr__(self) -> str:
        return f"Registry({len(self)} models from {[str(p) for p in self._paths]})"


def default_registry_paths(
    env: Mapping[str, str] = os.environ, cli_path: Path | None = None
) -> list[Path]:
    """Which registry files to load, in override order (later files win).

    ``--registry`` (``cli_path``) replaces everything; else ``$MLXD_REGISTRY`` (one path or
    several separated by ``os.pathsep``); else the packaged default followed by the user's
    ``<MLXD_HOME>/models.yaml``, so user entries override packaged ones.
    """
    if cli_path is not None:
        return [Path(cli_path).expanduser()]
    from_env = env.get(REGISTRY_ENV, "")
    if from_env.strip():
        return [Path(p).expanduser() for p in from_env.split(os.pathsep) if p.strip()]
    paths: list[Path] = []
    packaged = packaged_registry_path()
    if packaged is not None:
        paths.append(packaged)
    paths.append(user_registry_path(env))
    return paths
