"""`mlxd run` starting the daemon itself, from a working directory full of look-alike packages:
the real console script, a real background `mlxd serve` on a free port serving the embedded
`tiny` pairing, and its real log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxd.daemon import autostart
from mlxd.daemon.lifecycle import registry_filter
from tests.conftest import free_port
from tests.daemon.test_cli import _pid_from_log, _pids_with_env, _terminate, answers, cli_env

IDLE_WINDOW_S = 30.0
SHADOWS = ("api", "daemon", "engine", "registry", "mlxd")  # our folder names, and the package's


def mlxd_command() -> list[str]:
    """The installed `mlxd` script, as a user runs it; else this interpreter on the module."""
    script = Path(sys.executable).parent / "mlxd"
    if script.is_file():
        return [str(script)]
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "mlxd.daemon.cli"]  # fmt: skip


def shadowing_dir(root: Path) -> Path:
    """A project folder whose packages share our names; importing any of them fails loudly."""
    root.mkdir(parents=True, exist_ok=True)
    for name in SHADOWS:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(
            f"raise ImportError('the {name}/ of the working directory was imported')\n"
        )
    (root / "engine" / "manager.py").write_text("this is not python (\n")
    return root


def mlxd(args: list[str], cwd: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*mlxd_command(), *args], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def lines(log: Path) -> int:
    return len(log.read_bytes().splitlines())


@dataclass
class Spawned:
    env: dict[str, str]
    base: str
    home: Path
    log: Path
    cwd: Path


def stop_spawned(spawned: Spawned, marker: str) -> None:
    """Terminate what our environment started (found by its marker, else by the logged pid)."""
    pids = set(_pids_with_env(marker)) if Path("/proc").is_dir() else set()
    if not pids and (logged := _pid_from_log(spawned.log)) is not None:
        pids = {logged}
    for pid in pids:
        _terminate(pid)


@pytest.fixture
def spawn_env(tmp_path: Path) -> Iterator[Spawned]:
    """A fresh home, a free port, the packaged registry, and a shadowing working directory."""
    port = free_port()
    token = uuid.uuid4().hex
    home = tmp_path / "home"
    env = cli_env(port, MLXD_HOME=str(home), MLXD_TEST_MARKER=token)
    spawned = Spawned(env, f"http://127.0.0.1:{port}", home, autostart.log_path(home),
                      shadowing_dir(tmp_path / "project"))  # fmt: skip
    try:
        yield spawned
    finally:
        stop_spawned(spawned, f"MLXD_TEST_MARKER={token}")
        assert not answers(spawned.base), "the spawned daemon is still running"


@pytest.fixture(scope="module")
def autostarted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Spawned, subprocess.CompletedProcess[str]]]:  # fmt: skip
    """`mlxd run tiny --verbose "def f("` from the shadowing folder, with no daemon running."""
    root = tmp_path_factory.mktemp("autostart")
    port = free_port()
    token = uuid.uuid4().hex
    home = root / "home"
    env = cli_env(port, MLXD_HOME=str(home), MLXD_TEST_MARKER=token)
    spawned = Spawned(env, f"http://127.0.0.1:{port}", home, autostart.log_path(home),
                      shadowing_dir(root / "project"))  # fmt: skip
    try:
        assert not answers(spawned.base)
        yield spawned, mlxd(["run", "tiny", "--verbose", "def f("], spawned.cwd, env)
    finally:
        stop_spawned(spawned, f"MLXD_TEST_MARKER={token}")
        assert not answers(spawned.base), "the spawned daemon is still running"


def test_run_from_a_shadowing_directory_starts_the_daemon(
    autostarted: tuple[Spawned, subprocess.CompletedProcess[str]],
) -> None:
    spawned, result = autostarted
    log_text = spawned.log.read_text(errors="replace") if spawned.log.is_file() else ""
    assert result.returncode == 0, result.stderr + log_text
    assert result.stdout.strip(), "no completion printed"
    assert "eval count:" in result.stderr  # --verbose, given between the model and the prompt
    assert f"Starting the mlxd daemon for {spawned.base} (log: {spawned.log})" in result.stderr
    assert (
        "of the working directory was imported" not in log_text
    )  # no folder of the working directory was imported
    assert answers(spawned.base)  # and it keeps running in the background


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="reads /proc")
def test_the_daemon_runs_in_its_home_with_a_safe_path(
    autostarted: tuple[Spawned, subprocess.CompletedProcess[str]],
) -> None:
    spawned, _ = autostarted
    pid = _pid_from_log(spawned.log)
    assert pid is not None
    assert Path(f"/proc/{pid}/cwd").resolve() == spawned.home.resolve()
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    assert os.path.isabs(argv[0])
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    assert argv[1:] == [*safe_path, "-m", "mlxd.daemon.cli", "serve"]


def test_an_idle_daemon_writes_nothing_to_its_log(
    autostarted: tuple[Spawned, subprocess.CompletedProcess[str]],
) -> None:
    """A count of lines over an idle window (the registry watcher used to see every log line
    as a change, and log that it had)."""
    spawned, result = autostarted
    assert result.returncode == 0
    before = lines(spawned.log)
    time.sleep(IDLE_WINDOW_S)
    assert answers(spawned.base)
    assert lines(spawned.log) == before, spawned.log.read_text(errors="replace")[-3000:]


def test_a_daemon_that_cannot_start_fails_run_with_its_error(spawn_env: Spawned) -> None:
    """A garbage registry (named relative to the caller's folder) makes `serve` exit 1; `run`
    stops waiting when the child exits, rather than at its 60 s bound, and shows why."""
    (spawn_env.cwd / "broken.yaml").write_text("models: [\n")
    env = {**spawn_env.env, "MLXD_REGISTRY": "broken.yaml"}
    result = mlxd(["run", "tiny", "hello"], spawn_env.cwd, env)
    assert result.returncode == 1
    assert f"Starting the mlxd daemon for {spawn_env.base}" in result.stderr
    assert "mlxd serve exited with status 1 while starting" in result.stderr
    assert f"{spawn_env.cwd / 'broken.yaml'}:2: invalid YAML" in result.stderr  # the child's own
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not answers(spawn_env.base)


def test_a_daemon_that_cannot_bind_fails_run_with_its_error(spawn_env: Spawned) -> None:
    """MLXD_HOST names an address no interface has: the bind fails, serve exits 1."""
    env = {**spawn_env.env, "MLXD_HOST": "192.0.2.1:11434"}  # TEST-NET-1: never local
    result = mlxd(["list"], spawn_env.cwd, env)
    assert result.returncode == 1
    assert "mlxd serve exited with status 1 while starting" in result.stderr
    assert "Error: listen tcp 192.0.2.1:11434: bind:" in result.stderr


# -- the pieces, in process --------------------------------------------------------------------


def test_child_env_makes_our_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = autostart.child_env(
        {"MLXD_REGISTRY": f"a.yaml{os.pathsep}/abs/b.yaml", "MLXD_CACHE_DIR": "cache", "X": "y"},
        tmp_path / "home",
    )
    assert env == {
        "MLXD_REGISTRY": f"{tmp_path / 'a.yaml'}{os.pathsep}/abs/b.yaml",
        "MLXD_CACHE_DIR": str(tmp_path / "cache"),
        "MLXD_HOME": str(tmp_path / "home"),
        "X": "y",
    }


def test_log_tail_reads_only_what_the_child_wrote(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("old run\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("".join(f"line {i}\n" for i in range(30)))
    assert autostart.log_tail(log, offset, lines=3) == "line 27\nline 28\nline 29"
    assert autostart.log_tail(log, log.stat().st_size) == ""
    assert autostart.log_tail(tmp_path / "missing.log", 0) == ""


def test_registry_filter_passes_only_the_registry_files(tmp_path: Path) -> None:
    files = {tmp_path / "models.yaml", tmp_path / "other" / "extra.yaml"}
    keep = registry_filter(files)
    from watchfiles import Change

    assert keep(Change.modified, str(tmp_path / "models.yaml"))
    assert keep(Change.added, str(tmp_path / "other" / "extra.yaml"))
    assert not keep(Change.modified, str(tmp_path / "logs" / "server.log"))
    assert not keep(Change.modified, str(tmp_path / "models.yaml.swp"))
    assert not keep(Change.added, str(tmp_path / "other" / "models.yaml"))
