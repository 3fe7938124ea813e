"""Starting `mlxd serve` in the background for a CLI command, and saying so.

The child is our own interpreter (absolute path) running our module, in a folder we own
($MLXD_HOME) and, on Python 3.11+, with `-P`: whatever sits in the caller's working directory
(an `api/` or `mlxd/` folder of some project) can never be imported in its place. While it
starts we watch it: if it exits, the caller learns at once, with the end of its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mlxd.registry.home import ensure_home
from mlxd.registry.registry import REGISTRY_ENV

LOG_NAME = "server.log"
TAIL_LINES = 20
POLL_S = 0.1


class DaemonStartError(RuntimeError):
    """The background daemon did not come up; the message ends with its log's last lines."""


@dataclass(frozen=True)
class Started:
    process: subprocess.Popen[bytes]
    log: Path
    offset: int  # the log's size before the child wrote to it


def log_path(home: Path) -> Path:
    return home / "logs" / LOG_NAME


def serve_command() -> list[str]:
    """This interpreter by absolute path (not whichever `mlxd` is first on PATH) on our module."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [os.path.abspath(sys.executable), *safe_path, "-m", "mlxd.daemon.cli", "serve"]


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path)) if path.strip() else path


def child_env(environ: Mapping[str, str], home: Path) -> dict[str, str]:
    """The caller's environment with the paths the daemon reads made absolute (relative to the
    caller's working directory, since the child runs in `home`)."""
    env = dict(environ)
    env["MLXD_HOME"] = str(home)
    if env.get("MLXD_CACHE_DIR"):
        env["MLXD_CACHE_DIR"] = _absolute(env["MLXD_CACHE_DIR"])
    if env.get(REGISTRY_ENV):
        env[REGISTRY_ENV] = os.pathsep.join(map(_absolute, env[REGISTRY_ENV].split(os.pathsep)))
    return env


def start(environ: Mapping[str, str] = os.environ) -> Started:
    """Spawn `mlxd serve` detached from our session, its output appended to the log."""
    home = ensure_home(environ).resolve()
    log = log_path(home)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as log_file:
        offset = log_file.tell()
        process = subprocess.Popen(
            serve_command(),
            cwd=home,
            env=child_env(environ, home),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    return Started(process, log, offset)


def log_tail(log: Path, offset: int, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines the child wrote (from `offset` on)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def wait_until_up(started: Started, answers: Callable[[], bool], wait: float) -> None:
    """Poll until the daemon answers; raise DaemonStartError as soon as the child exits (or
    after `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        code = started.process.poll()
        if code is not None:
            if answers():  # another daemon took the address meanwhile
                return
            tail = log_tail(started.log, started.offset) or "(nothing logged)"
            raise DaemonStartError(
                f"mlxd serve exited with status {code} while starting; "
                f"the end of {started.log}:\n{tail}"
            )
        if answers():
            return
        if time.monotonic() >= deadline:
            raise DaemonStartError(
                f"mlxd serve did not answer within {wait:.0f} s; see {started.log}"
            )
        time.sleep(POLL_S)
