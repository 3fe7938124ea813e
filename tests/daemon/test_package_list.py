"""Every Python package folder of the project is in the wheel: setuptools installs only the
packages pyproject lists, so a new subpackage left out works in an editable install (tests)
and is missing from `pip install .` (users)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _section(text: str, name: str) -> str:
    start = text.index(f"[{name}]\n") + len(name) + 3
    end = text.find("\n[", start)
    return text[start : end if end >= 0 else len(text)]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    packages = set(re.findall(r'^\s+"(mlxd[\w.]*)",$', _section(text, "tool.setuptools"), re.M))
    dirs = dict(re.findall(r'^"(mlxd[\w.]*)" = "([\w/]+)"$', _section(text, "tool.setuptools.package-dir"), re.M))  # fmt: skip
    assert packages == set(dirs)
    found = {
        init.parent.relative_to(ROOT)
        for top in ("api", "daemon", "engine", "registry")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == {Path(folder) for folder in dirs.values()}
