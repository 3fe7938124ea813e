"""A request asking for an absurd draft length is served like any other: the engine clamps it."""

from __future__ import annotations

import httpx

from mlxd.engine.speculation import MAX_DRAFT_TOKENS
from tests.conftest import RunningServer


def test_a_huge_draft_num_predict_neither_wedges_nor_changes_the_output(
    server: RunningServer,
) -> None:
    def generate(options: dict[str, object]) -> dict[str, object]:
        body = {
            "model": "pair", "prompt": "the quick brown fox", "stream": False,
            "options": {"temperature": 0, "num_predict": 24, **options},
        }  # fmt: skip
        r = httpx.post(f"{server.base_url}/api/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out: dict[str, object] = r.json()
        return out

    plain = generate({"draft_method": "off"})
    for method in ("model", "lookup", "auto"):
        huge = generate({"draft_method": method, "draft_num_predict": 100_000})
        assert huge["response"] == plain["response"], method  # lossless, as ever
        by_position = huge.get("draft_acceptance_by_position") or []
        assert isinstance(by_position, list) and len(by_position) <= MAX_DRAFT_TOKENS
