"""An absurd draft length is refused at the edge; the largest allowed one is served losslessly."""

from __future__ import annotations

import httpx

from mlxd.registry.bounds import MAX_DRAFT_TOKENS
from tests.conftest import RunningServer


def _generate(server: RunningServer, options: dict[str, object]) -> httpx.Response:
    body = {
        "model": "pair", "prompt": "the quick brown fox", "stream": False,
        "options": {"temperature": 0, "num_predict": 24, **options},
    }  # fmt: skip
    return httpx.post(f"{server.base_url}/api/generate", json=body, timeout=120)


def test_a_huge_draft_num_predict_is_a_400_naming_the_bound(server: RunningServer) -> None:
    r = _generate(server, {"draft_method": "model", "draft_num_predict": 100_000})
    assert r.status_code == 400
    assert str(MAX_DRAFT_TOKENS) in r.json()["error"]


def test_the_largest_draft_num_predict_neither_wedges_nor_changes_the_output(
    server: RunningServer,
) -> None:
    plain = _generate(server, {"draft_method": "off"})
    assert plain.status_code == 200, plain.text
    for method in ("model", "lookup", "auto"):
        r = _generate(server, {"draft_method": method, "draft_num_predict": MAX_DRAFT_TOKENS})
        assert r.status_code == 200, r.text
        huge = r.json()
        assert huge["response"] == plain.json()["response"], method  # lossless, as ever
        by_position = huge.get("draft_acceptance_by_position") or []
        assert isinstance(by_position, list) and len(by_position) <= MAX_DRAFT_TOKENS
