"""`GET /metrics` on a real server: counters move with real requests, read back with
Prometheus' own text parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ServerThread, wait_for, write_registry
from tests.fixtures.tiny_models import TinyPair

TINY, PAIR = "tiny:latest", "pair:latest"
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 6}
# Longer than one prefix-cache block (64 tokens), so a repeat finds full blocks cached.
LONG_PROMPT = " ".join(f"word{i}" for i in range(120))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base: str) -> Samples:
    r = httpx.get(f"{base}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def served(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("metrics")
    registry = write_registry(root / "models.yaml", tiny_pair)
    server = ServerThread(registry, cache_dir=root / "kv")
    with server:
        yield server


def test_generation_counters(served: ServerThread) -> None:
    base = served.info.base_url
    before = scrape(base)
    assert value(before, "mlxd_queue_depth") == 0
    finals = []
    with httpx.Client(base_url=base, timeout=120) as http:
        for prompt in ("hello", "why is the sky blue"):
            r = http.post(
                "/api/generate",
                json={"model": "tiny", "prompt": prompt, "stream": False, "options": GREEDY},
            )
            assert r.status_code == 200, r.text
            finals.append(r.json())
        body = {"model": "pair", "messages": [{"role": "user", "content": "hi"}], "options": GREEDY}
        with http.stream("POST", "/api/chat", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        finals.append(json.loads(lines[-1]))
        assert (
            http.post("/api/generate", json={"model": "nosuch", "prompt": "x"}).status_code == 404
        )

    requests = "mlxd_http_requests_total"
    # a request is counted once its handler returns, which may be just after the client has
    # read the last line of its stream
    assert wait_for(lambda: value(scrape(base), requests, route="/api/chat", status="200") == 1)
    after = scrape(base)
    assert (
        value(after, requests, route="/api/generate", status="200")
        - value(before, requests, route="/api/generate", status="200")
        == 2
    )
    assert value(after, requests, route="/api/chat", status="200") == 1
    assert value(after, requests, route="/api/generate", status="404") == 1
    assert value(after, requests, route="/metrics", status="200") >= 1

    assert value(after, "mlxd_output_tokens_total", model=TINY) == sum(
        f["eval_count"] for f in finals[:2]
    )
    assert value(after, "mlxd_prompt_tokens_total", model=TINY) == sum(
        f["prompt_eval_count"] for f in finals[:2]
    )
    assert value(after, "mlxd_output_tokens_total", model=PAIR) == finals[2]["eval_count"]
    assert value(after, "mlxd_time_to_first_token_seconds_count", model=TINY) == 2
    assert value(after, "mlxd_time_to_first_token_seconds_count", model=PAIR) == 1
    assert value(after, "mlxd_time_to_first_token_seconds_sum", model=TINY) > 0
    assert value(after, "mlxd_time_per_output_token_seconds_count", model=TINY) == 2
    assert value(after, "mlxd_generations_total", model=TINY, reason="length") == 2

    chat = finals[2]
    assert chat["draft_method"] != "off"
    method = chat["draft_method"]
    assert (
        value(after, "mlxd_draft_tokens_proposed_total", model=PAIR, method=method)
        == (chat["draft_count"])
    )
    assert (
        value(after, "mlxd_draft_tokens_accepted_total", model=PAIR, method=method)
        == (chat["draft_accepted"])
    )

    assert value(after, "mlxd_model_loads_total", model=TINY) == 1
    assert value(after, "mlxd_model_loads_total", model=PAIR) == 1
    assert value(after, "mlxd_models_loaded") == 2
    assert value(after, "mlxd_memory_arrays_bytes") > value(before, "mlxd_memory_arrays_bytes")
    assert value(after, "mlxd_runner_restarts_total", model=TINY) == 0
    assert wait_for(lambda: total(scrape(base), "mlxd_rows_running") == 0)
    assert value(after, "mlxd_queue_depth") == 0


def test_a_preflight_is_counted_under_its_route(served: ServerThread) -> None:
    """A CORS preflight is answered before routing; it counts under the route it asks about,
    not as a path no route serves."""
    base = served.info.base_url
    requests = "mlxd_http_requests_total"
    before = value(scrape(base), requests, route="/api/chat", status="204")
    headers = {"Origin": "http://localhost", "Access-Control-Request-Method": "POST"}
    assert httpx.options(f"{base}/api/chat", headers=headers).status_code == 204
    assert httpx.options(f"{base}/nowhere", headers=headers).status_code == 204
    after = scrape(base)
    assert value(after, requests, route="/api/chat", status="204") == before + 1
    assert value(after, requests, route="unmatched", status="204") >= 1


def test_a_stream_the_client_leaves_midway_counts_as_499(served: ServerThread) -> None:
    """As nginx logs "client closed request": a stream cut by its client is not a 200."""
    base = served.info.base_url
    requests = "mlxd_http_requests_total"
    before = scrape(base)
    # an answer that cannot end before the client leaves (the grammar holds the end of
    # sequence back): one that could would race the departure to a 200
    letters = {"regex": "([a-z]{100}){3000}"}
    options = {"num_predict": 100000, "temperature": 0, "grammar": letters}
    body = {"model": "tiny", "prompt": "count", "options": options}
    with (
        httpx.Client(base_url=base, timeout=120) as http,
        http.stream("POST", "/api/generate", json=body) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())  # the first token arrived: the response started
    assert wait_for(
        lambda: (
            value(scrape(base), requests, route="/api/generate", status="499")
            == value(before, requests, route="/api/generate", status="499") + 1
        )
    )
    after = scrape(base)
    assert value(after, requests, route="/api/generate", status="200") == value(
        before, requests, route="/api/generate", status="200"
    )


def test_runner_restarts_are_counted(served: ServerThread) -> None:
    """Zero for every loaded model until whatever restarts a runner reports it."""
    base = served.info.base_url
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/api/generate", json={"model": "tiny", "prompt": "", "stream": False})
        assert r.status_code == 200
    assert value(scrape(base), "mlxd_runner_restarts_total", model=TINY) == 0
    served.state.manager.runner_restarted(TINY)
    assert value(scrape(base), "mlxd_runner_restarts_total", model=TINY) == 1


def test_prefix_cache_tiers(tiny_pair: TinyPair, tmp_path: Path) -> None:
    """A RAM tier too small for any block sends every block to the SSD tier: the repeat is an
    SSD hit, and the write backlog drains to zero. A second server in the same process keeps
    its own registry of metrics."""
    registry = write_registry(tmp_path / "models.yaml", tiny_pair)
    with ServerThread(registry, cache_dir=tmp_path / "kv", cache_ram_bytes=1) as info:
        base = info.base_url
        assert (
            value(scrape(base), "mlxd_http_requests_total", route="/api/generate", status="200")
            == 0
        )
        body = {"model": "tiny", "prompt": LONG_PROMPT, "raw": True, "stream": False}
        with httpx.Client(base_url=base, timeout=120) as http:
            first = http.post("/api/generate", json={**body, "options": GREEDY})
            assert first.status_code == 200, first.text
            assert wait_for(
                lambda: (
                    value(scrape(base), "mlxd_prefix_cache_ssd_write_backlog_blocks") == 0
                    and value(scrape(base), "mlxd_prefix_cache_inserted_blocks_total") > 0
                )
            )
            second = http.post("/api/generate", json={**body, "options": GREEDY})
            assert second.status_code == 200, second.text
        after = scrape(base)
        assert second.json()["prompt_cache_tokens"] > 0
        assert value(after, "mlxd_prefix_cache_hit_blocks_total", tier="ssd") >= 1
        assert value(after, "mlxd_prefix_cache_hit_bytes_total", tier="ssd") > 0
        assert value(after, "mlxd_prefix_cache_hit_bytes_total", tier="ram") == 0
        assert value(after, "mlxd_prefix_cache_bytes", tier="ssd") > 0
        assert (
            value(after, "mlxd_prompt_cached_tokens_total", model=TINY)
            == (second.json()["prompt_cache_tokens"])
        )
        assert (
            value(after, "mlxd_prefix_cache_hit_tokens_total")
            == (second.json()["prompt_cache_tokens"])
        )


def test_evictions(tiny_pair: TinyPair, tmp_path: Path) -> None:
    """With room for one model, loading a second evicts the first."""
    registry = write_registry(tmp_path / "models.yaml", tiny_pair)
    with ServerThread(registry, max_loaded=1, cache_ssd_bytes=0) as info:
        base = info.base_url
        for model in ("tiny", "pair"):
            r = httpx.post(
                f"{base}/api/generate",
                json={"model": model, "prompt": "", "stream": False},
                timeout=120,
            )
            assert r.status_code == 200, r.text
        after = scrape(base)
        assert value(after, "mlxd_model_evictions_total", model=TINY) == 1
        assert value(after, "mlxd_model_evictions_total", model=PAIR) == 0
        assert value(after, "mlxd_model_loads_total", model=TINY) == 1
        assert value(after, "mlxd_model_loads_total", model=PAIR) == 1
        assert value(after, "mlxd_models_loaded") == 1
