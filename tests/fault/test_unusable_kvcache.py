"""`mlxd serve` starts and serves when its kvcache directory cannot be used, without the SSD
tier, saying so in its log (a WARNING) and in `/api/mlxd/stats`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlxd.engine.prefix_cache import Namespace, PrefixCache, block_keys
from tests.cache.blocks import chain, make_block
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 90.0  # a bound on process start: correctness, not speed


def a_file(home: Path) -> str:
    (home / "kvcache").write_text("not a directory")
    return "is not a directory"


def a_dangling_symlink(home: Path) -> str:
    (home / "kvcache").symlink_to(home / "Volumes" / "external-ssd" / "kvcache")
    return "No such file or directory (is its disk unmounted?)"


def a_symlink_loop(home: Path) -> str:
    (home / "kvcache").symlink_to(home / "loop")
    (home / "loop").symlink_to(home / "kvcache")
    return "symlink loop"


def under_a_file(home: Path) -> str:
    (home / "kvcache").symlink_to(home / "file" / "kvcache")
    (home / "file").write_text("")
    return "Not a directory"


def no_permission(home: Path) -> str:
    (home / "kvcache").mkdir(mode=0o500)
    return "Permission denied"


CASES: dict[str, Callable[[Path], str]] = {
    "file": a_file,
    "dangling-symlink": a_dangling_symlink,
    "symlink-loop": a_symlink_loop,
    "under-a-file": under_a_file,
    "no-permission": no_permission,
}


QUICK = ("dangling-symlink", "file")


@pytest.mark.parametrize(
    "case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.fault_full) for c in CASES]
)
def test_the_daemon_serves_without_an_unusable_ssd_tier(
    case: str, registry_file: Path, tmp_path: Path
) -> None:
    if case == "no-permission" and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    home = tmp_path / "home"
    home.mkdir()
    reason = CASES[case](home)
    before = _tree(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_HOST", "MLXD_CACHE_DIR")}
    env.update(MLXD_HOST=f"127.0.0.1:{port}", MLXD_HOME=str(home), PYTHONIOENCODING="utf-8")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry_file)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _answers(base):
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "mlxd serve did not come up"
                time.sleep(0.1)
            body = {"model": "sys", "prompt": "hi", "stream": False}
            r = httpx.post(f"{base}/api/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["done"] is True
            stats = httpx.get(f"{base}/api/mlxd/stats", timeout=30).json()["prefix_cache"]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert proc.returncode == 0, text
    assert stats["ssd"].startswith("off: ") and reason in stats["ssd"], stats["ssd"]
    assert stats["ssd_bytes"] == 0
    warning = [line for line in text.splitlines() if "WARNING" in line and "SSD tier off" in line]
    assert len(warning) == 1 and reason in warning[0], text
    # Nothing was created through the broken path, and the symlinks are left as they were.
    probes = {p for p in _tree(tmp_path) if p == "home/probes" or p.startswith("home/probes/")}
    assert _tree(tmp_path) - {"serve.log", "home/digests.json"} - probes == before


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("case", list(CASES))
def test_the_cache_runs_on_ram_when_its_directory_is_unusable(case: str, tmp_path: Path) -> None:
    """Every case in-process, through the facade the daemon builds."""

    if case == "no-permission" and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    home = tmp_path / "home"
    home.mkdir()
    reason = CASES[case](home)
    before = _tree(tmp_path)
    cache = PrefixCache(64 << 20, home / "kvcache", 64 << 20)
    try:
        assert cache.ssd is None
        snap = cache.snapshot()
        assert snap["ssd"].startswith("off: ") and reason in snap["ssd"]
        ns = Namespace(model="ram-only")
        tokens = chain(2)
        for i, key in enumerate(block_keys(tokens, ns, 64)):
            cache.insert(key, make_block(i))
        assert len(cache.lookup(ns, tokens)) == 2  # the RAM tier serves
    finally:
        cache.close()
    assert _tree(tmp_path) == before
