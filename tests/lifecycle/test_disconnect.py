"""A client that leaves before anything is written to it: a request waiting in the queue for
its model gives up its place and loads nothing; a non-streamed generation ends with it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerThread, free_port, wait_for
from tests.fixtures.tiny_embedders import build_wordpiece, write_bert
from tests.fixtures.tiny_models import TARGET_SHAPE, TinyPair, write_model

REPO = Path(__file__).resolve().parents[2]
# an answer far longer than the test waits: the grammar holds back the end of sequence, and
# the registry's models take contexts of 32k tokens (at 4k the slow model's answer ended
# after 40 s on a 2-core machine, inside a long test: it then made room it should not have)
LONG = {"num_predict": 300000, "temperature": 0, "grammar": {"regex": "([a-z]{100}){3000}"}}


@pytest.fixture(scope="module")
def registry(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`slow`: a model of some size, whose long answer takes tens of seconds; `other`: a
    second model, for a request that must wait for room."""
    root = tmp_path_factory.mktemp("disconnect")
    slow = write_model(
        root / "slow", tiny_pair.tokenizer_dir, seed=5, max_position_embeddings=40000,
        hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=768,
    )  # fmt: skip
    other = write_model(
        root / "other", tiny_pair.tokenizer_dir, seed=6, max_position_embeddings=40000,
        **TARGET_SHAPE,
    )  # fmt: skip
    embedder = write_bert(root / "minilm", build_wordpiece(root / "wordpiece"), seed=11)
    path = root / "models.yaml"
    long = "    options:\n      num_ctx: 32768\n"
    path.write_text(
        f"models:\n  slow:\n    target: {slow}\n{long}  embedder:\n    target: {embedder}\n"
        f"  other:\n    target: {other}\n{long}",
        encoding="utf-8",
    )
    return path


def up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stats(base: str) -> dict:
    return httpx.get(f"{base}/api/mlxd/stats", timeout=30).json()


def running(base: str) -> int:
    """Rows the engine is decoding (not requests the API holds: a row could outlive them)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    rows = [line.split()[-1] for line in text.splitlines() if line.startswith("mlxd_rows_running")]
    return int(sum(float(v) for v in rows))


def leave_early(base: str, path: str, body: dict) -> None:
    """POST `body` and leave after a second without an answer."""
    client = httpx.Client(timeout=httpx.Timeout(30, read=1.0))
    with client, pytest.raises(httpx.TimeoutException):
        client.post(f"{base}{path}", json=body)


@contextlib.contextmanager
def streaming(base: str, model: str) -> Iterator[Iterator[str]]:
    """`model` decoding a long answer meanwhile (holding a place); its lines are yielded."""
    body = {"model": model, "prompt": "hello", "options": LONG}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{base}/api/generate", json=body) as busy,
    ):
        lines = busy.iter_lines()  # kept: a dropped iterator closes the response
        next(lines)
        yield lines


def in_background(base: str, model: str) -> tuple[threading.Thread, list[httpx.Response]]:
    """A short non-streamed generate on `model` from a thread; its response lands in the list."""
    body = {"model": model, "prompt": "hi", "stream": False}
    got: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: got.append(httpx.post(f"{base}/api/generate", json=body, timeout=120))
    )
    thread.start()
    return thread, got


@contextlib.contextmanager
def serving(
    registry: Path, tmp_path: Path, **settings: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`mlxd serve` in a process of its own (signals reach it as they reach a daemon), with
    `settings` in its environment: the process and its base URL. Afterwards it is killed if
    still running, and its log holds no fault."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLLAMA_", "MLXD_HOST"))}
    env.update(MLXD_HOST=f"127.0.0.1:{port}", MLXD_CACHE_DIR=str(tmp_path / "kvcache"))
    env.update(settings)
    cmd = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--registry", str(registry)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=log_file)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: up(base), timeout=90), "mlxd serve did not start"
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text(encoding="utf-8")
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log


def test_a_non_streamed_generation_ends_when_its_client_leaves(registry: Path) -> None:
    with ServerThread(registry, num_parallel=1) as srv:
        warm = {"model": "slow", "prompt": "", "keep_alive": -1}  # loaded before the clock runs
        assert httpx.post(f"{srv.base_url}/api/generate", json=warm, timeout=120).status_code == 200
        leave_early(srv.base_url, "/api/generate",
                    {"model": "slow", "prompt": "hello", "stream": False, "options": LONG})  # fmt: skip
        assert wait_for(lambda: running(srv.base_url) == 0, 15)


@pytest.mark.parametrize(
    ("model", "path", "body"),
    [("other", "/api/generate", {"prompt": "hi", "stream": True}),
     ("embedder", "/api/embed", {"input": "hi"}),
     ("embedder", "/v1/embeddings", {"input": "hi"})],
)  # fmt: skip
def test_a_request_waiting_for_room_leaves_the_queue_and_loads_nothing(
    registry: Path, model: str, path: str, body: dict
) -> None:
    with ServerThread(registry, max_loaded=1, num_parallel=1) as srv:
        base = srv.base_url
        with streaming(base, "slow"):  # `slow` holds the only place
            leaver = threading.Thread(
                target=leave_early, args=(base, path, {"model": model, **body})
            )
            leaver.start()  # waits for room, then leaves
            # (a stream's client may be gone before its wait shows: then `slow` is back)
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 1 or not leaver.is_alive())
            assert running(base) == 1  # chosen to make room, its rows are still counted
            leaver.join(30)
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 0, 20)
        assert wait_for(lambda: running(base) == 0, 20)
        loaded = [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
        assert f"{model}:latest" not in loaded
        assert "slow:latest" in loaded  # chosen to make room for it, it stays: nobody waits
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'mlxd_model_evictions_total{model="slow:latest"} 0.0' in metrics  # never went


def test_sigterm_ends_running_streams_with_an_error_and_refuses_waiting_ones(
    registry: Path, tmp_path: Path
) -> None:
    """The stream in flight ends with an error line (not a cut connection), a request waiting
    for room gets a JSON 503, and the daemon exits 0 with nothing logged as a fault."""
    one_place = {"MLXD_MAX_LOADED_MODELS": "1", "MLXD_NUM_PARALLEL": "1"}
    with serving(registry, tmp_path, **one_place) as (proc, base):
        with streaming(base, "slow") as lines:
            waiter, waited = in_background(base, "other")
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 1, 20)
            proc.send_signal(signal.SIGTERM)
            last = json.loads([line for line in lines if line][-1])
            waiter.join(60)
        assert last == {"error": "mlxd is shutting down"}
        assert waited and waited[0].status_code == 503
        assert waited[0].json() == {"error": "mlxd is shutting down"}
        assert proc.wait(60) == 0


def test_sigterm_answers_running_and_queued_embeddings_at_once(
    registry: Path, tmp_path: Path
) -> None:
    """An embedding in flight and one queued behind it on the model's runner get the JSON
    503 when the daemon is told to stop (they waited for the server's shutdown timeout, then
    got a plain-text 500)."""
    got: dict[str, httpx.Response] = {}
    with serving(registry, tmp_path) as (proc, base):

        def embed(name: str, inputs: Any) -> None:
            body = {"model": "embedder", "input": inputs}
            got[name] = httpx.post(f"{base}/api/embed", json=body, timeout=120)

        embed("warm", "hi")
        many = ["why is the sky blue on a clear day " * 6] * 40000  # tens of seconds here
        threads = [threading.Thread(target=embed, args=("running", many))]
        threads[0].start()
        assert wait_for(lambda: running(base) == 1, 30)
        threads.append(threading.Thread(target=embed, args=("queued", "x")))
        threads[1].start()
        assert wait_for(lambda: running(base) == 2, 30)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        for name in ("running", "queued"):
            assert got[name].status_code == 503, (name, got[name].text)
            assert got[name].json() == {"error": "mlxd is shutting down"}
        assert proc.wait(60) == 0


def test_a_request_waiting_for_an_entry_removed_meanwhile_loads_nothing(
    registry: Path, tmp_path: Path
) -> None:
    """The load decision reads the registry as it is then: a removed entry is not loaded for
    the request that waited for it (404), and nothing of it stays resident."""
    edited = tmp_path / "models.yaml"
    edited.write_text(registry.read_text(encoding="utf-8"), encoding="utf-8")
    with ServerThread(edited, max_loaded=1, num_parallel=1) as srv:
        base = srv.base_url
        with streaming(base, "slow"):
            waiter, waited = in_background(base, "other")
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 1, 20)
            kept = registry.read_text(encoding="utf-8").split("  other:")[0]
            edited.write_text(kept, encoding="utf-8")
            tags = f"{base}/api/tags"
            names = lambda: {m["name"] for m in httpx.get(tags).json()["models"]}  # noqa: E731
            assert wait_for(lambda: "other:latest" not in names(), 20)
        waiter.join(60)
        assert waited and waited[0].status_code == 404, waited[0].text
        loaded = [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
        assert "other:latest" not in loaded


def test_one_load_evicts_one_model(registry: Path, tmp_path: Path, tiny_pair: TinyPair) -> None:
    """Both places busy: the model chosen to make room is waited for, and the other, idle
    meanwhile, stays loaded (as Ollama's scheduler waits for the runner it chose). `third` is
    a model of its own: an entry on `other`'s files would share its loaded base, and would
    then take it without waiting, where its probe ended before the request came."""
    three = tmp_path / "models.yaml"
    third = write_model(tmp_path / "third", tiny_pair.tokenizer_dir, seed=7, **TARGET_SHAPE)
    three.write_text(
        registry.read_text(encoding="utf-8") + f"  third:\n    target: {third}\n", "utf-8"
    )
    with ServerThread(three, max_loaded=2, num_parallel=1) as srv:
        base = srv.base_url
        with streaming(base, "slow"):
            with streaming(base, "other"):
                waiter, done = in_background(base, "third")

                def chosen() -> bool:
                    """`third` waits, and `slow` was chosen to make room for it (`third`
                    may wait for its probe first: `other` idle by then would go instead)."""
                    now = stats(base)
                    slow = [m for m in now["models"] if m["name"] == "slow:latest"]
                    return now["queue"]["waiting"] == 1 and bool(slow) and slow[0]["stopping"]

                assert wait_for(chosen, 60)

            # `other` is idle now, `slow` (chosen, the least recently used) still streams
            def active() -> dict[str, int]:
                return {m["name"]: m["active"] for m in stats(base)["models"]}

            assert wait_for(lambda: active() == {"slow:latest": 1, "other:latest": 0}, 60)
        waiter.join(60)
        assert done and done[0].status_code == 200
        loaded = {m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]}
        assert loaded == {"other:latest", "third:latest"}


def test_an_embedding_forward_stops_when_its_client_leaves(registry: Path) -> None:
    """Between its batches a forward nobody waits for any more ends: the next request on the
    model is answered at once, not after the departed one's thousands of inputs."""
    with ServerThread(registry, num_parallel=1) as srv:
        base = srv.base_url
        warm = httpx.post(
            f"{base}/api/embed", json={"model": "embedder", "input": "hi"}, timeout=120
        )
        assert warm.status_code == 200
        many = {"model": "embedder", "input": [f"line {i} of many " * 20 for i in range(20000)]}
        leave_early(base, "/api/embed", many)
        r = httpx.post(f"{base}/api/embed", json={"model": "embedder", "input": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["embeddings"][0] == warm.json()["embeddings"][0]


def test_told_to_stop_a_non_streamed_generation_and_a_load_waiter_get_503(
    registry: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon stopping is no fault of the engine's: a non-streamed request it ends gets
    the 503 a waiting one gets, and a request whose model finishes loading after the stop is
    refused before it generates."""
    from mlxd.engine import runner

    server = ServerThread(registry, num_parallel=1)
    with server as srv:
        base = srv.base_url
        long = {"model": "slow", "prompt": "hello", "stream": False, "options": LONG}
        thread = threading.Thread(
            target=lambda: got.append(httpx.post(f"{base}/api/generate", json=long, timeout=120))
        )
        got: list[httpx.Response] = []
        thread.start()
        assert wait_for(lambda: running(base) == 1, 60)

        loading, finish = threading.Event(), threading.Event()
        real = runner.load_pairing

        def held(*args: Any, **kwargs: Any) -> Any:
            loading.set()
            finish.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(runner, "load_pairing", held)
        waiter, waited = in_background(base, "other")
        assert loading.wait(60)
        server.state.stop_serving()
        finish.set()
        thread.join(60)
        waiter.join(60)
        assert got[0].status_code == 503, got[0].text
        assert got[0].json() == {"error": "mlxd is shutting down"}
        assert waited[0].status_code == 503, waited[0].text
        assert running(base) == 0


@pytest.mark.parametrize("kind", ["generate", "embed"])
def test_a_client_leaving_during_a_load_leaves_the_others_their_answer(
    registry: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Every request waiting for one load awaits one future: the one whose client left
    cancelled it for all of them (500s), and the loaded model's runner died on it."""
    from mlxd.engine import runner
    from mlxd.engine.embedding import runner as embed_runner

    module, loader, model = (
        (runner, "load_pairing", "other")
        if kind == "generate"
        else (embed_runner, "load_embedder", "embedder")
    )
    loading, finish = threading.Event(), threading.Event()
    real = getattr(module, loader)

    def held(*args: Any, **kwargs: Any) -> Any:
        loading.set()
        finish.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, loader, held)
    path, body = (
        (
            "/api/generate",
            {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
        )
        if kind == "generate"
        else ("/api/embed", {"model": model, "input": "hi"})
    )
    with ServerThread(registry, num_parallel=2) as srv:
        base = srv.base_url
        got: list[httpx.Response] = []
        stayer = threading.Thread(
            target=lambda: got.append(httpx.post(f"{base}{path}", json=body, timeout=120))
        )
        stayer.start()
        assert loading.wait(60)
        leave_early(base, path, body)  # waits on the same load, then leaves
        finish.set()
        stayer.join(120)
        assert got and got[0].status_code == 200, got[0].text if got else "no answer"
        again = httpx.post(f"{base}{path}", json=body, timeout=120)  # the runner serves on
        assert again.status_code == 200, again.text
