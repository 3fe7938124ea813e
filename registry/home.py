"""Where mlxd keeps its own state, and where the packaged default registry lives."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "DEFAULT_HOME",
    "REGISTRY_FILENAME",
    "ensure_home",
    "mlxd_home",
    "packaged_registry_path",
    "user_registry_path",
]

DEFAULT_HOME = "~/.mlxd"
REGISTRY_FILENAME = "models.yaml"


def mlxd_home(env: Mapping[str, str] = os.environ) -> Path:
    """``$MLXD_HOME`` or ``~/.mlxd``; not created here, so reading config has no side effects."""
    return Path(env.get("MLXD_HOME") or DEFAULT_HOME).expanduser()


def ensure_home(env: Mapping[str, str] = os.environ) -> Path:
    """Return :func:`mlxd_home`, creating it first (for writers such as the digest cache)."""
    home = mlxd_home(env)
    home.mkdir(parents=True, exist_ok=True)
    return home


def user_registry_path(env: Mapping[str, str] = os.environ) -> Path:
    """The user's own registry, ``<home>/models.yaml``; optional, it may not exist."""
    return mlxd_home(env) / REGISTRY_FILENAME


def packaged_registry_path() -> Path | None:
    """The default ``models.yaml`` shipped with mlxd, or None if this install has none.

    A source or editable checkout has it at the project root; a wheel installs it as
    setuptools data-files under ``<prefix>/share/mlxd``.
    """
    candidates = (
        Path(__file__).resolve().parent.parent / REGISTRY_FILENAME,
        Path(sys.prefix) / "share" / "mlxd" / REGISTRY_FILENAME,
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    return None
