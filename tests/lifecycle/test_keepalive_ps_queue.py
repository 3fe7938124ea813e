"""Model lifecycle through the real server: keep_alive, /api/ps, eviction by count and by memory
budget, the bounded wait queue, `mlxd ps` / `mlxd stop`, and /api/mlxd/stats."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.daemon.cli import human_size
from mlxd.daemon.config import Settings
from mlxd.daemon.server import build_state
from mlxd.engine.backend import configure_backend
from mlxd.engine.manager import estimate_need
from mlxd.registry.schema import ModelEntry
from tests.conftest import RunningServer, ServerThread, free_port, wait_for
from tests.fixtures.tiny_models import TinyPair

REPO = Path(__file__).resolve().parents[2]
QUEUE_FULL = {"error": "server busy, please try again.  maximum pending requests exceeded"}
PS_FIELDS = {"name", "model", "size", "size_vram", "digest", "details", "expires_at", "context_length"}  # fmt: skip
TINY, SYS = "tiny:latest", "sys:latest"


def ps(base: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{base}/api/ps")
    assert r.status_code == 200
    return {m["name"]: m for m in r.json()["models"]}


def stats(base: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/api/mlxd/stats")
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


def load(base: str, model: str, **extra: Any) -> httpx.Response:
    """An empty prompt: loads (or with keep_alive 0 unloads) the model."""
    body = {"model": model, "prompt": "", "stream": False, **extra}
    return httpx.post(f"{base}/api/generate", json=body, timeout=60)


def generate(base: str, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
    return httpx.post(f"{base}/api/generate", json={**body, **extra}, timeout=60)


def seconds_until(stamp: str) -> float:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", stamp), stamp
    then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return (then - datetime.now(timezone.utc)).total_seconds()


def tiny_need(pair: TinyPair, rows: int = 4) -> int:
    entry = ModelEntry(name="tiny", target=str(pair.target))
    return estimate_need(entry, rows, configure_backend()).total


@pytest.fixture(scope="module")
def srv(registry_file: Path) -> Iterator[RunningServer]:
    with ServerThread(registry_file) as info:
        yield info


@pytest.fixture
def base(srv: RunningServer) -> Iterator[str]:
    """The module's server with nothing loaded before and after each test."""
    yield srv.base_url
    for name in ps(srv.base_url):
        load(srv.base_url, name, keep_alive=0)
    assert wait_for(lambda: not ps(srv.base_url))


# -- keep_alive and /api/ps ------------------------------------------------------------------


def test_empty_prompt_loads_and_ps_lists_the_model(base: str, tiny_pair: TinyPair) -> None:
    assert ps(base) == {}
    r = load(base, "tiny")
    assert r.status_code == 200
    assert r.json()["done_reason"] == "load" and r.json()["done"] is True
    model = ps(base)[TINY]
    assert set(model) == PS_FIELDS
    assert model["model"] == TINY
    assert model["size"] == tiny_need(tiny_pair)
    on_gpu = configure_backend().device == "gpu"  # a CPU-only host holds nothing in VRAM
    assert model["size_vram"] == (model["size"] if on_gpu else 0)
    tags = {m["name"]: m for m in httpx.get(f"{base}/api/tags").json()["models"]}
    assert model["digest"] == tags[TINY]["digest"]
    assert model["details"] == tags[TINY]["details"]
    assert model["context_length"] == 2048  # min(default num_ctx 4096, the model's 2048)
    assert 200 < seconds_until(model["expires_at"]) <= 300  # the default keep_alive, 5m
    time.sleep(0.05)  # an idle model's expiry is a moment, not "keep_alive from now"
    assert ps(base)[TINY]["expires_at"] == model["expires_at"]


def test_chat_with_no_messages_loads_too(base: str) -> None:
    r = httpx.post(f"{base}/api/chat", json={"model": "tiny", "stream": False}, timeout=60)
    assert r.json()["done_reason"] == "load"
    assert TINY in ps(base)


def test_keep_alive_expiry(base: str) -> None:
    assert load(base, "tiny", keep_alive=1).json()["done_reason"] == "load"
    assert seconds_until(ps(base)[TINY]["expires_at"]) <= 1.0
    assert wait_for(lambda: TINY not in ps(base), timeout=15)


def test_keep_alive_zero_unloads_at_once(base: str) -> None:
    load(base, "tiny")
    r = load(base, "tiny", keep_alive=0)
    assert r.status_code == 200
    assert r.json()["done_reason"] == "unload" and r.json()["response"] == ""
    assert TINY not in ps(base)
    # unloading a model that is not loaded answers the same
    assert load(base, "tiny", keep_alive="0s").json()["done_reason"] == "unload"


def test_keep_alive_zero_on_a_generation_unloads_after_it(base: str) -> None:
    r = generate(base, "tiny", keep_alive=0)
    assert r.status_code == 200 and r.json()["done_reason"] in ("stop", "length")
    assert wait_for(lambda: TINY not in ps(base), timeout=10)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_loading_and_unloading_leaves_no_threads_behind(base: str) -> None:
    """A client that unloads after every request (`keep_alive: 0`) must not grow the daemon's
    threads: MLX never ends a thread's stream workers, so a thread per model left them behind
    (two or three a cycle, until the system refused more)."""

    def cycle() -> None:
        assert generate(base, "tiny", keep_alive=0).status_code == 200
        assert wait_for(lambda: TINY not in ps(base), timeout=10)

    for _ in range(2):  # the pools that serve requests reach their size
        cycle()
    before = _os_threads()
    for _ in range(8):
        cycle()
    assert _os_threads() - before < 4


@pytest.mark.parametrize("keep_alive", [-1, "-1m", -0.5])
def test_negative_keep_alive_is_forever(base: str, keep_alive: object) -> None:
    load(base, "tiny", keep_alive=keep_alive)
    stamp = ps(base)[TINY]["expires_at"]
    assert int(stamp[:4]) >= 2300
    assert stats(base)["models"][0]["keep_alive"] == -1


def test_a_request_without_keep_alive_keeps_the_current_one(base: str) -> None:
    load(base, "tiny", keep_alive="1h")
    assert generate(base, "tiny").status_code == 200
    assert seconds_until(ps(base)[TINY]["expires_at"]) > 3000
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    httpx.post(f"{base}/api/chat", json={**chat, "options": {"num_predict": 2}}, timeout=60)
    assert seconds_until(ps(base)[TINY]["expires_at"]) > 3000
    assert stats(base)["models"][0]["keep_alive"] == 3600
    # a request that names one sets it
    assert generate(base, "tiny", keep_alive="2m").status_code == 200
    assert 60 < seconds_until(ps(base)[TINY]["expires_at"]) <= 120


def test_ps_is_sorted_by_expiry_latest_first(base: str) -> None:
    load(base, "tiny", keep_alive="10m")
    load(base, "sys", keep_alive=-1)
    assert list(ps(base)) == [SYS, TINY]
    load(base, "tiny", keep_alive=-1)
    load(base, "sys", keep_alive="1m")
    assert list(ps(base)) == [TINY, SYS]


def test_bad_keep_alive_is_a_400(base: str) -> None:
    r = load(base, "tiny", keep_alive="3600")
    assert r.status_code == 400
    assert r.json() == {"error": 'time: missing unit in duration "3600"'}


# -- /api/mlxd/stats ---------------------------------------------------------------------------


def test_stats_fields(base: str, tiny_pair: TinyPair) -> None:
    empty = stats(base)
    assert empty["models"] == [] and empty["totals"]["loaded"] == 0
    load(base, "tiny", keep_alive="4m")
    body = stats(base)
    assert set(body) >= {"models", "totals", "queue", "memory", "limits", "device"}
    (model,) = body["models"]
    need = tiny_need(tiny_pair)
    assert model["name"] == TINY
    assert model["active"] == 0 and model["waiting"] == 0
    assert model["loading"] is False and model["stopping"] is False
    assert model["size"] == need
    assert model["size"] == model["weights_bytes"] + model["kv_bytes"] + model["overhead_bytes"]
    assert model["weights_bytes"] == (Path(tiny_pair.target) / "model.safetensors").stat().st_size
    # KV: 2 × 2 layers × 2 kv heads × 16 dims × 4 bytes (float32) × 2048 tokens × 4 rows
    assert model["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 2048 * 4
    assert model["keep_alive"] == 240 and 200 < model["expires_in"] <= 240
    assert seconds_until(model["expires_at"]) > 200
    assert body["totals"] == {"loaded": 1, "active": 0, "waiting": 0, "size": need}
    assert body["queue"] == {"waiting": 0, "max": 512}
    assert body["memory"]["used"] == need and body["memory"]["budget"] > need
    assert body["memory"]["free"] == body["memory"]["budget"] - need
    assert body["limits"] == {
        "max_loaded_models": 3, "num_parallel": 4, "default_keep_alive": 300,
        "runner_stall_s": 120.0, "runner_stalls": 0,
    }  # fmt: skip
    assert body["device"] in ("cpu", "gpu")


# -- eviction -------------------------------------------------------------------------------


def test_max_loaded_one_evicts_the_idle_model(registry_file: Path) -> None:
    with ServerThread(registry_file, max_loaded=1) as srv:
        load(srv.base_url, "tiny")
        assert list(ps(srv.base_url)) == [TINY]
        assert load(srv.base_url, "sys").json()["done_reason"] == "load"
        assert list(ps(srv.base_url)) == [SYS]
        assert generate(srv.base_url, "tiny").status_code == 200
        assert list(ps(srv.base_url)) == [TINY]


def test_memory_budget_evicts_to_fit(registry_file: Path, tiny_pair: TinyPair) -> None:
    need = tiny_need(tiny_pair)
    with ServerThread(registry_file, memory_budget=need * 3 // 2) as srv:
        base = srv.base_url
        load(base, "tiny", keep_alive=-1)
        assert stats(base)["memory"] == {
            "budget": need * 3 // 2,
            "budget_source": "MLXD_MEMORY_BUDGET",
            "used": need,
            "free": need // 2,
        }
        assert load(base, "sys").json()["done_reason"] == "load"  # fits only without tiny
        assert list(ps(base)) == [SYS]
        assert stats(base)["memory"]["used"] == need

        # a busy model is not evicted mid-stream: the load waits until it is done
        long = {"model": "sys", "prompt": "Once", "options": {"num_predict": 2000}}
        with httpx.Client(timeout=60) as client, ThreadPoolExecutor(1) as pool:
            request = client.build_request("POST", f"{base}/api/generate", json=long)
            busy = client.send(request, stream=True)
            lines = busy.iter_lines()  # keep it: a collected iterator closes the stream
            assert json.loads(next(lines))["done"] is False
            pending = pool.submit(load, base, "tiny")
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 1)
            (sys_stats,) = stats(base)["models"]
            assert sys_stats["stopping"] is True and sys_stats["active"] == 1
            assert not pending.done()
            busy.close()
            assert pending.result(timeout=60).json()["done_reason"] == "load"
        assert list(ps(base)) == [TINY]


def test_memory_budget_smaller_than_the_model_fails_clearly(
    registry_file: Path, tiny_pair: TinyPair
) -> None:
    with ServerThread(registry_file, memory_budget=1024 * 1024) as srv:
        r = load(srv.base_url, "tiny")
        assert r.status_code == 500
        message = r.json()["error"]
        assert re.fullmatch(
            r"model requires [\d.]+ MiB but only 1\.0 MiB are available \(memory budget: .+\)",
            message,
        ), message
        r = generate(srv.base_url, "tiny")
        assert r.status_code == 500 and r.json()["error"] == message
        assert ps(srv.base_url) == {}


# -- the wait queue ---------------------------------------------------------------------------


def test_queue_limit_answers_503(registry_file: Path) -> None:
    long = {"model": "tiny", "prompt": "Once upon a time", "options": {"num_predict": 2000}}
    settings = {"max_queue": 1, "num_parallel": 1}  # one row: a second request must wait
    with ServerThread(registry_file, **settings) as srv, httpx.Client(timeout=60) as client:
        base = srv.base_url
        running = client.send(client.build_request("POST", f"{base}/api/generate", json=long), stream=True)  # fmt: skip
        lines = running.iter_lines()
        assert json.loads(next(lines))["done"] is False  # the runner is busy with it
        queued = client.send(client.build_request("POST", f"{base}/api/generate", json=long), stream=True)  # fmt: skip
        assert wait_for(lambda: stats(base)["queue"]["waiting"] == 1)
        assert stats(base)["models"][0]["waiting"] == 1

        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: generate(base, "tiny"), range(3)))
        refused = [r for r in answers if r.status_code == 503]
        assert len(refused) >= 2, [r.status_code for r in answers]  # all 3 unless `running` ended
        assert all(r.status_code in (200, 503) for r in answers)
        for r in refused:
            assert r.json() == QUEUE_FULL
            assert (
                r.text
                == '{"error":"server busy, please try again.  maximum pending requests exceeded"}'
            )

        running.close()
        queued.close()
        assert wait_for(lambda: idle(base))
        assert generate(base, "tiny").status_code == 200


def test_requests_arriving_together_take_the_free_rows_before_the_queue(
    registry_file: Path,
) -> None:
    """Only a request that waits for a model or a row takes a place in the queue: five sent
    at once to a loaded model with four rows and a queue of one are all answered (the four
    that found free rows counted as waiting until the runner started them, and refused the
    rest with 503)."""
    settings = {"max_queue": 1, "num_parallel": 4}
    with ServerThread(registry_file, **settings) as srv:
        assert generate(srv.base_url, "tiny").status_code == 200  # loaded
        for _ in range(3):
            with ThreadPoolExecutor(5) as pool:
                answers = list(pool.map(lambda _: generate(srv.base_url, "tiny"), range(5)))
            assert [r.status_code for r in answers] == [200] * 5
        assert wait_for(lambda: idle(srv.base_url))


# -- CLI --------------------------------------------------------------------------------------


def mlxd(port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_HOST", "MLXD_REGISTRY")}
    env["MLXD_HOST"] = f"127.0.0.1:{port}"
    return subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=120, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_cli_ps_and_stop(srv: RunningServer, base: str, tiny_pair: TinyPair) -> None:
    empty = mlxd(srv.port, "ps")
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]

    load(base, "tiny", keep_alive="4m30s")
    load(base, "sys", keep_alive=-1)
    listed = mlxd(srv.port, "ps")
    assert listed.returncode == 0, listed.stderr
    header, first, second = listed.stdout.splitlines()
    assert re.split(r"\s{2,}", header) == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    processor = f"100% {stats(base)['device'].upper()}"
    ids = {name: m["digest"][:12] for name, m in ps(base).items()}  # sys: tiny's files, its own ID
    assert ids[SYS] != ids[TINY]
    size = human_size(tiny_need(tiny_pair))
    assert re.split(r"\s{2,}", first) == [SYS, ids[SYS], size, processor, "2048", "Forever"]
    assert re.split(r"\s{2,}", second) == [TINY, ids[TINY], size, processor, "2048", "4 minutes from now"]  # fmt: skip

    stopped = mlxd(srv.port, "stop", "tiny")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == ""
    assert list(ps(base)) == [SYS]

    missing = mlxd(srv.port, "stop", "nosuch")
    assert missing.returncode == 1
    assert missing.stderr.strip() == 'Error: couldn\'t find model "nosuch" to stop'


def test_cli_without_a_daemon() -> None:
    result = mlxd(free_port(), "ps")
    assert result.returncode == 1
    assert "could not connect to mlxd server" in result.stderr


# -- settings from the environment ------------------------------------------------------------


def test_env_settings_reach_the_manager() -> None:
    settings = Settings.from_env(
        {
            "OLLAMA_KEEP_ALIVE": "90",
            "OLLAMA_MAX_LOADED_MODELS": "2",
            "OLLAMA_MAX_QUEUE": "7",
            "OLLAMA_NUM_PARALLEL": "2",
            "MLXD_NUM_PARALLEL": "3",
            "MLXD_MEMORY_BUDGET": "8GiB",
        }
    )
    manager = build_state(settings, configure_backend()).manager
    assert manager.default_keep_alive == 90
    assert manager.max_loaded == 2
    assert manager.queue.limit == 7
    assert manager.num_parallel == 3  # MLXD_ wins over OLLAMA_
    assert manager.budget.bytes == 8 * 2**30
    defaults = build_state(Settings.from_env({}), configure_backend()).manager
    assert (defaults.default_keep_alive, defaults.max_loaded) == (300, 3)
    assert (defaults.queue.limit, defaults.num_parallel) == (512, 4)
    assert defaults.budget.source.startswith("75% of ")


def test_mlxd_serve_reads_lifecycle_env(registry_file: Path) -> None:
    """End to end: `mlxd serve` with Ollama's variable names."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLLAMA_", "MLXD_HOST"))}
    env.update(
        MLXD_HOST=f"127.0.0.1:{port}",
        OLLAMA_KEEP_ALIVE="1",
        OLLAMA_MAX_LOADED_MODELS="1",
        OLLAMA_MAX_QUEUE="3",
        MLXD_MEMORY_BUDGET="1GiB",
    )
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry_file)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _up(base), timeout=90), "mlxd serve did not start"
        body = stats(base)
        assert body["queue"]["max"] == 3
        assert body["memory"]["budget"] == 2**30
        assert (
            body["limits"]["max_loaded_models"] == 1 and body["limits"]["default_keep_alive"] == 1
        )
        load(base, "tiny")
        load(base, "sys")
        assert list(ps(base)) in ([SYS], [])  # tiny evicted; sys expires after 1 s
        assert wait_for(lambda: not ps(base), timeout=15)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def idle(base: str) -> bool:
    body = stats(base)
    totals = body["totals"]
    return totals["active"] == totals["waiting"] == body["queue"]["waiting"] == 0


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/api/version", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
