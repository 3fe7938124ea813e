"""Type-check the `mlxd` package as it is installed: `python -m tools.typecheck`.

The repository keeps its four folders at the top level while the import package is `mlxd`, so
mypy (which cannot follow setuptools' editable import hook) reads them through a folder of
symbolic links, `mlxd/<folder> -> ../../<folder>`, kept under `.mypy_cache/`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("api", "daemon", "engine", "registry")


def link_farm(root: Path = ROOT) -> Path:
    """The folder whose `mlxd/` links to the subpackages; rebuilt when a link is missing."""
    farm = root / ".mypy_cache" / "mlxd-src"
    package = farm / "mlxd"
    package.mkdir(parents=True, exist_ok=True)
    for name in SUBPACKAGES:
        link = package / name
        if link.is_symlink() and link.resolve() != root / name:
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(root / name, target_is_directory=True)
    return farm


def main(argv: list[str] | None = None) -> int:
    farm = link_farm()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    env = {**os.environ, "MYPYPATH": str(farm)}
    result = subprocess.run([*cmd, "-p", "mlxd", *(argv or [])], cwd=ROOT, env=env)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
