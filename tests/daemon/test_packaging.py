"""The wheel as a user installs it: built from this source tree, installed into a fresh venv next
to python-daemon (whose import package is also called `daemon`). Nothing of ours may land at the
top of site-packages but `mlxd`, and the two `daemon`s must not touch each other.

Needs the package registry (to build the wheel and to fetch python-daemon): offline it skips,
saying so; where CI is set a registry it cannot reach fails the test instead, so CI always
runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OTHER = "python-daemon"
# Left out of the copy the wheel is built from: checkouts, environments, build leftovers.
NOT_SOURCE = (".git", ".venv", ".device", "build", "dist", "*.egg-info", "__pycache__",
              ".pytest_cache", ".mypy_cache", ".ruff_cache", "tests", "bench")  # fmt: skip

pytestmark = pytest.mark.network


def run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(
        list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def ok(cmd: Sequence[str], cwd: Path | None = None) -> str:
    result = run(cmd, cwd)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def registry_unreachable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the packaging test, but {reason}")
    pytest.skip(f"offline: {reason}")


def pip_takes_python() -> bool:
    """`pip --python` (pip 22.3+) installs into another environment from this one."""
    major, minor = (int(x) for x in re.findall(r"\d+", version("pip"))[:2])
    return (major, minor) >= (22, 3)


@dataclass
class Env:
    root: Path
    python: Path
    site: Path

    def pip(self, *args: str) -> str:
        if pip_takes_python():
            return ok([sys.executable, "-m", "pip", "--python", str(self.python), *args])
        return ok([str(self.python), "-m", "pip", *args])

    def python_ok(self, code: str) -> subprocess.CompletedProcess[str]:
        """`-I`: no working directory, PYTHONPATH or user site on sys.path; run from `root`."""
        return run([str(self.python), "-I", "-c", code], cwd=self.root)

    def top_level(self) -> set[str]:
        return {p.name for p in self.site.iterdir() if p.name != "__pycache__"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Env, set[str]]]:
    """(the venv after installing both wheels, its site-packages top level before)."""
    root = tmp_path_factory.mktemp("packaging")
    wheels = root / "wheels"
    fetched = run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), OTHER])
    if fetched.returncode != 0:
        registry_unreachable(f"pip could not fetch {OTHER}: {fetched.stderr.strip()[-500:]}")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), "."], source)
    assert built.returncode == 0, built.stdout + built.stderr
    (ours,) = wheels.glob("mlxd-*.whl")
    (theirs,) = wheels.glob("python_daemon-*.whl")

    target = root / "venv"
    venv.create(target, with_pip=not pip_takes_python())
    python = target / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(ok([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())  # fmt: skip
    env = Env(target, python, site)
    before = env.top_level()
    env.pip("install", "--no-deps", "--no-index", str(ours), str(theirs))
    yield env, before


def test_only_mlxd_lands_at_the_top_of_site_packages(installed: tuple[Env, set[str]]) -> None:
    env, before = installed
    added = env.top_level() - before
    ours = {"mlxd"} | {n for n in added if re.fullmatch(r"mlxd-[^-]+\.dist-info", n)}
    theirs = {n for n in added if n == "daemon" or re.fullmatch(r"python_daemon-[^-]+\.dist-info", n)}  # fmt: skip
    assert len(ours) == 2 and len(theirs) == 2, added
    assert added == ours | theirs  # nothing else of ours: no api/, engine/, registry/, daemon.py


def test_the_package_imports_and_its_folders_do_not(installed: tuple[Env, set[str]]) -> None:
    env, _ = installed
    code = "import mlxd.api, mlxd.daemon, mlxd.registry, mlxd.registry.embedded; print(mlxd.daemon.__file__)"  # fmt: skip
    result = env.python_ok(code)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == env.site / "mlxd" / "daemon" / "__init__.py"
    for name in ("api", "engine", "registry"):
        result = env.python_ok(f"import {name}")
        assert result.returncode != 0
        assert f"No module named '{name}'" in result.stderr


def test_both_daemons_import(installed: tuple[Env, set[str]]) -> None:
    env, _ = installed
    result = env.python_ok("import daemon, mlxd.daemon; print(daemon.__file__); print(daemon.DaemonContext)")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.splitlines()[0]) == env.site / "daemon" / "__init__.py"


def test_the_wheel_carries_the_tiny_pairing_and_the_default_registry(
    installed: tuple[Env, set[str]],
) -> None:
    env, _ = installed
    tiny = env.site / "mlxd" / "registry" / "embedded" / "tiny"
    for part in ("target", "draft"):
        assert (tiny / part / "model.safetensors").is_file()
        assert (tiny / part / "tokenizer.json").is_file()
    result = env.python_ok(
        "from mlxd.registry.home import packaged_registry_path; print(packaged_registry_path())"
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == env.root / "share" / "mlxd" / "models.yaml"
    assert (env.python.parent / "mlxd").is_file()  # the console script


def test_uninstalling_one_daemon_leaves_the_other(installed: tuple[Env, set[str]]) -> None:
    """Runs last in the module: it uninstalls both."""
    env, _ = installed
    env.pip("uninstall", "-y", OTHER)
    assert (env.site / "mlxd" / "daemon" / "__init__.py").is_file()
    assert not (env.site / "daemon").exists()
    assert env.python_ok("import mlxd.daemon").returncode == 0
    assert env.python_ok("import daemon").returncode != 0

    wheels = sorted(env.root.parent.glob("wheels/python_daemon-*.whl"))
    env.pip("install", "--no-deps", "--no-index", str(wheels[0]))
    env.pip("uninstall", "-y", "mlxd")
    assert (env.site / "daemon" / "__init__.py").is_file()
    left = [p for p in (env.site / "mlxd").rglob("*") if p.is_file()]  # pip may keep the folder
    assert left == []
    assert env.python_ok("import daemon").returncode == 0
    assert env.python_ok("import mlxd.daemon").returncode != 0
