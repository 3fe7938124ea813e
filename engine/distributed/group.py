"""The daemon's handle on a group of ranks: launched with `mlx.launch`, reached over a socket.

The daemon never joins the group itself. MLX's launcher stops every rank when one exits, and a
process whose peer vanishes can only fail its collective; the HTTP server must outlive both.
So the daemon runs the launcher as a child, listens on a private Unix socket, and rank 0 (on
this machine) connects to it. A rank that dies ends the launcher, which closes the socket: the
request in flight fails with the launcher's account of which rank exited, and the group is
marked lost (`status`) so the pairing answers with that reason until it is reloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.engine.distributed import wire
from mlxd.registry.distributed import Distribution

LOG_TAIL = 2000  # characters of the launcher's output quoted in an error


class GroupError(RuntimeError):
    """The ranks could not be started, or one of them is gone; the message says which."""


@dataclass
class GroupStatus:
    """What `ps` shows of a group: its ranks and, once lost, why."""

    name: str
    backend: str
    strategy: str
    ranks: list[str]
    lost: str | None = None
    started: float = field(default_factory=time.time)


_LIVE: dict[int, GroupStatus] = {}
_LOST: dict[str, str] = {}  # pairing name -> why its group was lost
_STATUS_LOCK = threading.Lock()


def statuses() -> list[GroupStatus]:
    """Every group this daemon runs now."""
    with _STATUS_LOCK:
        return list(_LIVE.values())


def lost_reason(name: str) -> str | None:
    """Why `name`'s group was lost (its pairing is unavailable until reloaded), or None."""
    with _STATUS_LOCK:
        return _LOST.get(name)


def forget_loss(name: str) -> None:
    with _STATUS_LOCK:
        _LOST.pop(name, None)


@dataclass(frozen=True)
class RankCache:
    """Each rank's prefix cache: RAM bytes, and an SSD tier under `root/<split>/rank<r>`."""

    ram_bytes: int = 256 * 2**20
    ssd_bytes: int = 0
    root: Path | None = None

    def args(self) -> list[str]:
        out = ["--cache-ram", str(self.ram_bytes)]
        if self.root is not None and self.ssd_bytes > 0:
            out += ["--cache-ssd", str(self.ssd_bytes), "--cache-dir", str(self.root)]
        return out


_RANK_CACHE = [RankCache()]


def configure_rank_cache(cache: RankCache) -> None:
    """What the ranks of groups started from now on keep (the daemon's prefix-cache settings;
    the same path is used on every host)."""
    _RANK_CACHE[0] = cache


def launcher() -> list[str]:
    """MLX's launcher: the `mlx.launch` script beside this interpreter or on PATH, else the
    same entry point run by this interpreter (an environment without console scripts)."""
    local = Path(sys.executable).with_name("mlx.launch")
    found = str(local) if local.exists() else shutil.which("mlx.launch")
    if found is not None:
        return [found]
    entry = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
    return [sys.executable, "-c", entry]


def free_port(count: int) -> int:
    """A loopback port with `count` free ports from it (the ring takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + count >= 65536:
            continue
        try:
            probes = []
            for i in range(1, count):
                p = socket.socket()
                probes.append(p)
                p.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for p in probes:
                p.close()
    raise GroupError("no free ports for the ring")


class Group:
    """A running group of ranks serving one sharded model; `call` is one request/answer."""

    def __init__(self, name: str, model_dir: Path, dist: Distribution, float32: bool) -> None:
        self.name = name
        self.dist = dist
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="mlxd-group-")
        path = os.path.join(self._dir, "rank0.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(1)
        self._log_path = os.path.join(self._dir, "launch.log")
        self._sock: socket.socket | None = None
        self.lost: str | None = None
        self._closing = False
        cmd = [*launcher(), "--verbose"]
        if dist.hostfile:
            cmd += ["--hostfile", dist.hostfile]
        else:
            cmd += ["--hosts", ",".join(dist.hosts)]
        if dist.backend != "auto":
            cmd += ["--backend", dist.backend]
        if dist.backend in ("ring", "auto"):
            port = dist.port or free_port(max(2, dist.world_size))
            cmd += ["--starting-port", str(port)]
        cmd += ["--", sys.executable, "-m", "mlxd.engine.distributed.worker"]
        cmd += ["--socket", path, "--model", str(model_dir), "--strategy", dist.strategy]
        cmd += ["--backend", dist.backend] + (["--float32"] if float32 else [])
        cmd += _RANK_CACHE[0].args()
        self._log = open(self._log_path, "wb")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.status = GroupStatus(name, dist.backend, dist.strategy, [])
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        with _STATUS_LOCK:
            _LIVE[id(self)] = self.status
            _LOST.pop(name, None)
        threading.Thread(target=self._watch, name=f"group:{name}", daemon=True).start()

    def _start(self) -> None:
        deadline = time.monotonic() + self.dist.timeout
        self._listener.settimeout(0.2)
        while self._sock is None:
            if self._proc.poll() is not None:
                raise GroupError(f"the ranks did not start: {self._tail()}")
            if time.monotonic() > deadline:
                raise GroupError(
                    f"rank 0 did not connect within {self.dist.timeout:.0f}s: {self._tail()}"
                )
            with contextlib.suppress(TimeoutError):
                self._sock, _ = self._listener.accept()
        self._sock.settimeout(self.dist.timeout)
        try:
            hello = wire.receive(self._sock)
        except (OSError, wire.PeerGone) as exc:
            raise GroupError(f"the ranks did not start ({exc}): {self._tail()}") from None
        errors = [f"rank {i}: {e}" for i, e in enumerate(hello["errors"]) if e]
        if errors:
            raise GroupError("; ".join(errors))
        self.size = int(hello["size"])
        _calm(self._proc.pid)
        self.status.ranks = [f"rank {i}: {r}" for i, r in enumerate(hello["ranks"])]

    def _tail(self) -> str:
        self._log.flush()
        try:
            text = Path(self._log_path).read_text(errors="replace")
        except OSError:
            return "(no launcher output)"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        exited = [ln for ln in lines if "exited with code" in ln]
        picked = exited or lines[-8:]
        return " | ".join(_strip_color(ln) for ln in picked)[-LOG_TAIL:] or "(no output)"

    def _watch(self) -> None:
        code = self._proc.wait()
        if not self._closing:
            self._mark_lost(f"the group ended (launcher exit {code}): {self._tail()}")

    def _mark_lost(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        self.status.lost = self.lost
        with _STATUS_LOCK:
            _LOST[self.name] = self.lost

    def call(self, ops: list[Any]) -> Any:
        """Send a journal to rank 0; what the last operation returned (a forward's logits)."""
        with self._lock:
            if self.lost is not None:
                raise GroupError(f"distributed model unavailable: {self.lost}")
            assert self._sock is not None
            try:
                wire.send(self._sock, ops)
                answer = wire.receive(self._sock)
            except (OSError, wire.PeerGone) as exc:
                time.sleep(0.5)  # let the launcher report which rank went first
                self._mark_lost(f"{exc}: {self._tail()}")
                raise GroupError(f"distributed model unavailable: {self.lost}") from None
        if answer["error"]:
            raise GroupError(answer["error"])
        return answer["logits"]

    def close(self) -> None:
        """Stop the ranks (politely, then by signal) and remove the socket."""
        self._closing = True
        with _STATUS_LOCK:
            _LIVE.pop(id(self), None)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                wire.send(self._sock, "quit")
            self._sock.close()
        polite = 30.0 if self._sock is not None else 0.0  # ranks that never started: no wait
        try:
            self._proc.wait(polite)  # the ranks write their prefix caches' RAM blocks out first
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
        self._listener.close()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _calm(pid: int) -> None:
    """Lowest priority for the launcher's threads: MLX's launcher relays the ranks' output in
    a loop that never blocks (it polls for a writable stdin), and on a small machine that loop
    takes CPU time from the ranks. Linux keeps a priority per thread (/proc lists them)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return
    for task in tasks.iterdir():
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)


def _strip_color(line: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", line)
