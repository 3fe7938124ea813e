"""Continuous batching: concurrent rows produce what each would alone; disconnects free rows."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx

from tests.conftest import ServerThread, wait_for


def generate(base: str, model: str, prompt: str, options: dict, results: dict, key: str) -> None:
    body = {"model": model, "prompt": prompt, "raw": False, "stream": True, "options": options}
    text, final = [], {}
    with httpx.stream("POST", f"{base}/api/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            obj = json.loads(line)
            assert "error" not in obj, obj
            text.append(obj.get("response", ""))
            if obj.get("done"):
                final = obj
    results[key] = ("".join(text), final)


PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(6)]


def test_concurrent_streams_match_solo_runs(registry_file: Path) -> None:
    options = {"temperature": 0, "num_predict": 24}
    for model in ("tiny", "pair"):
        with ServerThread(registry_file) as srv:
            alone: dict = {}
            for i, prompt in enumerate(PROMPTS):
                generate(srv.base_url, model, prompt, options, alone, str(i))
            together: dict = {}
            threads = [
                threading.Thread(
                    target=generate, args=(srv.base_url, model, p, options, together, str(i))
                )
                for i, p in enumerate(PROMPTS)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            for i in range(len(PROMPTS)):
                assert together[str(i)][0] == alone[str(i)][0], (model, i)
                assert together[str(i)][1]["context"] == alone[str(i)][1]["context"]
                assert together[str(i)][1]["eval_count"] == 24


def test_disconnect_frees_its_row_while_others_continue(registry_file: Path) -> None:
    long = {"temperature": 0, "num_predict": 4000, "num_ctx": 2048}
    server = ServerThread(registry_file)
    with server as srv:
        results: dict = {}
        keep = [
            threading.Thread(
                target=generate,
                args=(srv.base_url, "tiny", f"a{i}", {**long, "num_predict": 300}, results, str(i)),
            )
            for i in range(2)
        ]
        for t in keep:
            t.start()
        with httpx.stream(
            "POST", f"{srv.base_url}/api/generate",
            json={"model": "tiny", "prompt": "leaver", "options": long}, timeout=60,
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert wait_for(lambda: rows(server) == 3)
        # the client went away: its row is removed within a round, the others keep decoding
        assert wait_for(lambda: rows(server) <= 2)
        for t in keep:
            t.join(120)
        assert all(results[str(i)][1]["eval_count"] == 300 for i in range(2))
        assert wait_for(lambda: rows(server) == 0)


def rows(server: ServerThread) -> int:
    """Rows decoding right now, over every loaded pairing."""
    return sum(slot.runner.running_rows for slot in server.state.manager.loaded().values())
