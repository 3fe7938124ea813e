"""A client that leaves before anything is written to it: a request waiting in the queue for
its model gives up its place and loads nothing; a non-streamed generation ends with it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerThread, wait_for
from tests.fixtures.tiny_models import TARGET_SHAPE, TinyPair, write_model

# an answer far longer than the test waits: the grammar holds back the end of sequence
LONG = {
    "num_predict": 30000,
    "num_ctx": 32768,
    "temperature": 0,
    "grammar": {"regex": "([a-z]{100}){300}"},
}


@pytest.fixture(scope="module")
def registry(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`slow`: a model of some size, whose long answer takes tens of seconds; `other`: a
    second model, for a request that must wait for room."""
    root = tmp_path_factory.mktemp("disconnect")
    slow = write_model(
        root / "slow", tiny_pair.tokenizer_dir, seed=5, max_position_embeddings=40000,
        hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=768,
    )  # fmt: skip
    other = write_model(root / "other", tiny_pair.tokenizer_dir, seed=6, **TARGET_SHAPE)
    path = root / "models.yaml"
    path.write_text(
        f"models:\n  slow:\n    target: {slow}\n  other:\n    target: {other}\n",
        encoding="utf-8",
    )
    return path


def stats(base: str) -> dict:
    return httpx.get(f"{base}/api/mlxd/stats", timeout=30).json()


def running(base: str) -> int:
    """Rows the engine is decoding (not requests the API holds: a row could outlive them)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    rows = [line.split()[-1] for line in text.splitlines() if line.startswith("mlxd_rows_running")]
    return int(sum(float(v) for v in rows))


def leave_early(base: str, model: str, stream: bool) -> None:
    body = {"model": model, "prompt": "hello", "stream": stream, "options": LONG}
    client = httpx.Client(timeout=httpx.Timeout(30, read=1.0))
    with client, pytest.raises(httpx.TimeoutException):
        client.post(f"{base}/api/generate", json=body)


def test_a_non_streamed_generation_ends_when_its_client_leaves(registry: Path) -> None:
    with ServerThread(registry, num_parallel=1) as srv:
        warm = {"model": "slow", "prompt": "", "keep_alive": -1}  # loaded before the clock runs
        assert httpx.post(f"{srv.base_url}/api/generate", json=warm, timeout=120).status_code == 200
        leave_early(srv.base_url, "slow", stream=False)
        assert wait_for(lambda: running(srv.base_url) == 0, 15)


def test_a_request_waiting_for_room_leaves_the_queue_and_loads_nothing(registry: Path) -> None:
    with ServerThread(registry, max_loaded=1, num_parallel=1) as srv:
        base = srv.base_url
        body = {"model": "slow", "prompt": "hello", "options": LONG}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{base}/api/generate", json=body) as busy,
        ):
            lines = busy.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # `slow` holds the only place
            leave_early(base, "other", stream=True)  # waits for room, then leaves
            assert wait_for(lambda: stats(base)["queue"]["waiting"] == 0, 20)
        assert wait_for(lambda: running(base) == 0, 20)
        loaded = [m["name"] for m in httpx.get(f"{base}/api/ps").json()["models"]]
        assert "other:latest" not in loaded
