"""A pairing whose target is sharded over two processes (tensor parallel, ring over loopback)
serves the same tokens as the same pairing in one process, through the real HTTP API; and a
rank that dies ends the running stream with an error line while the daemon keeps serving."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, wait_for

PROMPTS = [
    "def fib(n):\n    return",
    "The quick brown fox",
    "Hello, world! Hello, world! Hello,",
    "import json\nimport os\n",
]


def generate(base: str, model: str, prompt: str, **options: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 24, **options},
    }
    r = httpx.post(f"{base}/api/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_solo_same_tokens_and_draft_stats(
    dist_server: RunningServer, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")  # drafting itself is pinned here, not its speed
    for prompt in PROMPTS[:2]:
        want = generate(dist_server.base_url, "local", prompt, draft_method=method)
        got = generate(dist_server.base_url, "dist", prompt, draft_method=method)
        assert got["response"] == want["response"]
        assert got["eval_count"] == want["eval_count"] == 24
        assert got["draft_method"] == method
        # how many drafts a round takes follows each pairing's measured costs: reported, and
        # never more accepted than drafted
        assert 0 <= got["draft_accepted"] <= got["draft_count"]
        assert 0.0 <= got["draft_acceptance_rate"] <= 1.0
    if method == "model":
        assert got["draft_count"] > 0


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_batch_of_four_same_tokens(dist_server: RunningServer, method: str) -> None:
    base = dist_server.base_url
    want = [generate(base, "local", p, draft_method=method)["response"] for p in PROMPTS]
    got: list[str | None] = [None] * len(PROMPTS)
    start = threading.Barrier(len(PROMPTS))

    def one(i: int) -> None:
        start.wait()
        got[i] = generate(base, "dist", PROMPTS[i], draft_method=method, num_predict=32)["response"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    # 32 tokens in a batch vs 24 alone: the first 24 tokens' text must lead
    for w, g in zip(want, got, strict=True):
        assert g is not None and g.startswith(w)


def ranks_of(base: str, model: str) -> list[str]:
    models = httpx.get(f"{base}/api/ps", timeout=30).json()["models"]
    return next(m.get("ranks") or [] for m in models if m["name"].split(":")[0] == model)


def test_ps_shows_the_ranks(dist_server: RunningServer) -> None:
    generate(dist_server.base_url, "dist", "x", num_predict=2)
    generate(dist_server.base_url, "local", "x", num_predict=2)
    ranks = ranks_of(dist_server.base_url, "dist")
    assert [r.split(":")[0] for r in ranks] == ["rank 0", "rank 1"]
    assert all(re.search(r"pid \d+", r) for r in ranks)
    assert ranks_of(dist_server.base_url, "local") == []


def test_rank_death_ends_the_stream_and_the_daemon_serves_on(dist_server: RunningServer) -> None:
    base = dist_server.base_url
    generate(base, "dist", "x", num_predict=2)
    rank1 = int(re.search(r"pid (\d+)", ranks_of(base, "dist")[1]).group(1))  # type: ignore[union-attr]
    body = {
        "model": "dist",
        "prompt": "def fib(n):",
        "raw": True,
        "options": {"temperature": 0, "num_predict": 100000, "draft_method": "off"},
    }
    lines: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{base}/api/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(json.loads(line))
            if len(lines) == 3:
                os.kill(rank1, signal.SIGKILL)
    assert len(lines) > 3
    assert "error" in lines[-1] and not lines[-1].get("done")
    assert "rank 1" in lines[-1]["error"] or "unavailable" in lines[-1]["error"]
    # the daemon stays up: the other pairing serves, this one answers with the reason
    assert generate(base, "local", "x", num_predict=4)["eval_count"] == 4
    r = httpx.post(f"{base}/api/generate", json={**body, "stream": False}, timeout=60)
    assert r.status_code >= 400 and "unavailable" in r.json()["error"]
    assert "rank 1" in r.json()["error"]
    assert wait_for(
        lambda: (
            not any(
                m["name"].startswith("dist") for m in httpx.get(f"{base}/api/ps").json()["models"]
            )
        )
    )
