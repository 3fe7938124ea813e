"""A pipeline split (mlx-lm's `model.pipeline`, here a tiny Qwen2: one layer per rank) serves the
one-process tokens; a split the architecture cannot take fails its probe with the reason while
the other pairings serve."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, ServerThread
from tests.distributed.conftest import ring_works
from tests.fixtures.tiny_models import DRAFT_SHAPE, TARGET_SHAPE, TinyPair, write_model

PROMPTS = ["def fib(n):\n    return", "The quick brown fox", "Hello, world!", "import os\n"]
HOSTS = "    distributed:\n      hosts: [127.0.0.1, 127.0.0.1]\n"


@pytest.fixture(scope="module")
def pipe_server(
    tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    why = ring_works()
    if why is not None:
        pytest.skip(f"MLX's ring backend cannot start two ranks on loopback here: {why}")
    root = tmp_path_factory.mktemp("pipe")
    tok = tiny_pair.tokenizer_dir
    qwen = write_model(root / "qwen", tok, seed=3, arch="qwen2", **TARGET_SHAPE)
    small = write_model(root / "qwen-draft", tok, seed=4, arch="qwen2", **DRAFT_SHAPE)
    registry = root / "models.yaml"
    registry.write_text(
        "models:\n"
        f"  localq:\n    target: {qwen}\n    draft: {small}\n"
        f"  pipe:\n    target: {qwen}\n    draft: {small}\n{HOSTS}"
        "      strategy: pipeline\n"
        f"  badsplit:\n    target: {tiny_pair.target}\n{HOSTS}      strategy: pipeline\n"
        # 192.0.2.1 is reserved for documentation: never reachable
        f"  faraway:\n    target: {tiny_pair.target}\n"
        "    distributed:\n      hosts: [127.0.0.1, 192.0.2.1]\n      timeout: 5\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info


def generate(base: str, model: str, prompt: str, **options: Any) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 20, **options},
    }
    return httpx.post(f"{base}/api/generate", json=body, timeout=300)


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_pipeline_same_tokens_solo_and_batched(pipe_server: RunningServer, method: str) -> None:
    base = pipe_server.base_url
    want = [generate(base, "localq", p, draft_method=method).json()["response"] for p in PROMPTS]
    solo = generate(base, "pipe", PROMPTS[0], draft_method=method).json()
    assert solo["response"] == want[0]
    assert solo["draft_method"] == method and "draft_acceptance_rate" in solo
    got: list[str] = [""] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait()
        got[i] = generate(base, "pipe", PROMPTS[i], draft_method=method).json()["response"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want


def test_a_split_the_model_cannot_take_fails_its_probe(pipe_server: RunningServer) -> None:
    r = generate(pipe_server.base_url, "badsplit", "x")
    assert r.status_code >= 400
    error = r.json()["error"]
    assert "unavailable" in error and "cannot be split as a pipeline" in error
    assert "rank 0" in error
    assert generate(pipe_server.base_url, "localq", "x").status_code == 200


def test_a_host_that_cannot_be_reached_fails_its_probe(pipe_server: RunningServer) -> None:
    r = generate(pipe_server.base_url, "faraway", "x")
    assert r.status_code >= 400
    error = r.json()["error"]
    assert "unavailable" in error and "cannot start the distributed target" in error
    assert "did not connect within 5s" in error or "did not start" in error
    assert generate(pipe_server.base_url, "localq", "x").status_code == 200
