"""Each rank keeps its own shard's prefix-cache blocks on disk, under its split and rank: a
prompt served before a restart is restored on both ranks after it, with the same tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerThread
from tests.distributed.conftest import distributed_registry, ring_works
from tests.fixtures.tiny_models import TinyPair

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 12  # several 64-token blocks


def ask(base: str) -> dict[str, object]:
    body = {
        "model": "dist",
        "prompt": PROMPT,
        "raw": True,
        "stream": False,
        "options": {"temperature": 0, "num_predict": 12, "draft_method": "model"},
    }
    r = httpx.post(f"{base}/api/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_prefix_hit_across_restarts_on_both_ranks(tiny_pair: TinyPair, tmp_path: Path) -> None:
    why = ring_works()
    if why is not None:
        pytest.skip(f"MLX's ring backend cannot start two ranks on loopback here: {why}")
    registry = distributed_registry(tmp_path / "models.yaml", tiny_pair)
    cache_dir = tmp_path / "kvcache"
    with ServerThread(registry, cache_dir=cache_dir) as server:
        first = ask(server.base_url)
    assert first["prompt_cache_tokens"] == 0
    ranks = sorted(p.name for p in (cache_dir / "distributed" / "tensorx2").iterdir())
    assert ranks == ["rank0", "rank1"]
    with ServerThread(registry, cache_dir=cache_dir) as server:
        again = ask(server.base_url)
    assert int(again["prompt_cache_tokens"]) >= 128  # type: ignore[call-overload]
    assert again["response"] == first["response"]
