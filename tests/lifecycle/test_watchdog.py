"""A runner stuck in a step: its requests end with an error line and the pairing reloads.

The tiny model's runner really blocks: MLXD_TEST_STALL_S (a test-only knob of
`mlxd.engine.runner`) makes the first step that hands out tokens block its thread, as a hung
kernel or a pathological request would. The watchdog's limit is set short for the test.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.engine import runner as runner_module
from tests.conftest import ServerThread, free_port, wait_for
from tests.fixtures.tiny_models import TinyPair

REPO = Path(__file__).resolve().parents[2]
STALL_LIMIT = 2.0  # seconds without a step before the watchdog steps in


def stream_lines(base: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    with httpx.stream("POST", f"{base}/api/generate", json=body, timeout=120) as r:
        return r.status_code, [json.loads(line) for line in r.iter_lines() if line.strip()]


def test_a_stuck_runner_fails_its_requests_and_the_pairing_reloads(
    tiny_pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    stall = runner_module.TestStall()
    monkeypatch.setattr(runner_module, "TEST_STALL", stall)
    monkeypatch.setenv(runner_module.STALL_ENV, "300")  # blocks far longer than the test runs
    body = {"model": "tiny", "prompt": "hello", "options": {"temperature": 0, "num_predict": 32}}
    server = ServerThread(registry, runner_stall_s=STALL_LIMIT)
    try:
        with server as srv:
            manager = server.state.manager
            status, lines = stream_lines(srv.base_url, body)
            assert status == 200
            assert lines[0].get("response") is not None and not lines[0].get("done")
            assert "error" in lines[-1], lines[-1]
            assert "stopped making progress" in lines[-1]["error"]
            assert not any(line.get("done") for line in lines)
            assert manager.stalls == 1

            # a fresh runner serves the pairing: the same request now completes
            status, lines = stream_lines(srv.base_url, body)
            assert status == 200
            assert lines[-1].get("done") is True, lines[-1]
            assert lines[-1]["eval_count"] == 32
            assert manager.stalls == 1
            stats = httpx.get(f"{srv.base_url}/api/mlxd/stats", timeout=30).json()
            assert [m["name"] for m in stats["models"]] == ["tiny:latest"]
            assert stats["limits"]["runner_stalls"] == 1
    finally:
        stall.release.set()  # the abandoned thread's step returns; it exits on its own
    assert not server.thread.is_alive(), "the server did not shut down"


def test_every_request_the_stuck_runner_holds_ends_with_an_error_line(
    tiny_pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Running and queued requests alike: none waits forever, none gets a broken stream."""
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    stall = runner_module.TestStall()
    monkeypatch.setattr(runner_module, "TEST_STALL", stall)
    monkeypatch.setenv(runner_module.STALL_ENV, "300")
    body = {"model": "tiny", "prompt": "hello", "options": {"temperature": 0, "num_predict": 32}}
    try:
        with ServerThread(registry, runner_stall_s=STALL_LIMIT) as srv:
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                results = list(pool.map(lambda _: stream_lines(srv.base_url, body), range(3)))
            failed = 0
            for status, lines in results:
                assert status == 200
                last = lines[-1]
                assert last.get("done") is True or "stopped" in last.get("error", ""), last
                failed += "error" in last
            assert failed >= 2  # the one running and at least one queued behind it
    finally:
        stall.release.set()


def test_the_stuck_thread_exits_once_its_step_returns(
    tiny_pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the abandoned thread still produces goes nowhere, and it lets go of the pairing."""
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    stall = runner_module.TestStall()
    monkeypatch.setattr(runner_module, "TEST_STALL", stall)
    monkeypatch.setenv(runner_module.STALL_ENV, "300")
    body = {
        "model": "tiny", "prompt": "hello", "stream": False,
        "options": {"temperature": 0, "num_predict": 16},
    }  # fmt: skip
    server = ServerThread(registry, runner_stall_s=STALL_LIMIT)
    with server as srv:
        load = httpx.post(f"{srv.base_url}/api/generate", json={"model": "tiny"}, timeout=120)
        assert load.status_code == 200, load.text
        stuck = server.state.manager.loaded()["tiny:latest"].runner
        r = httpx.post(f"{srv.base_url}/api/generate", json=body, timeout=120)
        assert r.status_code == 500  # nothing was sent yet: Ollama's error body
        assert "stopped making progress" in r.json()["error"]
        assert stuck.abandoned and not stuck.join(0.1)  # still blocked in its step
        stall.release.set()
        assert stuck.join(30)
        assert stuck.pairing is None  # it let go of the models
        r = httpx.post(f"{srv.base_url}/api/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 16


def test_the_daemon_stops_on_sigterm_with_a_runner_still_stuck(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    """`mlxd serve` whose abandoned runner never returns still exits 0 on SIGTERM: nothing
    waits for that thread, and no SIGKILL is needed."""
    registry = tmp_path / "models.yaml"
    registry.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLLAMA_", "MLXD_HOST"))}
    env.update(
        MLXD_HOST=f"127.0.0.1:{port}",
        MLXD_RUNNER_STALL_S=str(STALL_LIMIT),
        MLXD_TEST_STALL_S="600",
        MLXD_CACHE_DIR=str(tmp_path / "kvcache"),
    )
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": "hello", "options": {"temperature": 0, "num_predict": 8}}
    try:
        assert wait_for(lambda: _up(base), timeout=90), "mlxd serve did not start"
        _, lines = stream_lines(base, body)
        assert "stopped making progress" in lines[-1].get("error", ""), lines
        _, lines = stream_lines(base, body)
        assert lines[-1].get("done") is True, lines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text(encoding="utf-8")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text(encoding="utf-8")
    assert "made no progress" in log and "terminate called" not in log


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
