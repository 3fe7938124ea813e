"""Over HTTP: the context /api/ps reports (and the memory budget reserves) is the one a prompt
must fit and generation stops at; a request's num_ctx narrows it, never widens it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ServerThread
from tests.fixtures.tiny_models import TinyPair

NUM_CTX = 64


@pytest.fixture(scope="module")
def base(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    registry = tmp_path_factory.mktemp("context") / "models.yaml"
    registry.write_text(
        f"models:\n  short:\n    target: {tiny_pair.target}\n"
        f"    options:\n      num_ctx: {NUM_CTX}\n      temperature: 0\n",
        encoding="utf-8",
    )
    with ServerThread(Path(registry)) as info:
        yield info.base_url


def generate(base: str, tokens: int, **options: Any) -> httpx.Response:
    """A prompt of exactly `tokens` tokens: the rendered "x", after a context of 5s."""
    fill = tokens - rendered_tokens(base)
    assert fill >= 0, "the rendered prompt alone is longer"
    return _generate(base, [5] * fill, options)


def _generate(base: str, context: list[int], options: dict[str, Any]) -> httpx.Response:
    body = {"model": "short", "prompt": "x", "context": context, "stream": False,
            "options": options}  # fmt: skip
    return httpx.post(f"{base}/api/generate", json=body, timeout=120)


def rendered_tokens(base: str) -> int:
    """How many tokens "x" renders to (the template's own included)."""
    r = _generate(base, [], {"num_predict": 1})
    assert r.status_code == 200, r.text
    return int(r.json()["prompt_eval_count"])


def test_ps_reports_the_row_context(base: str) -> None:
    assert generate(base, 20, num_predict=1).status_code == 200
    (model,) = httpx.get(f"{base}/api/ps").json()["models"]
    assert model["context_length"] == NUM_CTX


@pytest.mark.parametrize("asked", [None, 4096])
def test_a_prompt_that_fills_the_row_is_cut_to_leave_room(base: str, asked: int | None) -> None:
    options = {"num_predict": 4} if asked is None else {"num_ctx": asked, "num_predict": 4}
    r = generate(base, NUM_CTX, **options)  # a wider num_ctx changes nothing
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["prompt_eval_count"] == NUM_CTX - 4
    assert done["eval_count"] == 4


def test_generation_stops_at_the_row_context_however_wide_the_request(base: str) -> None:
    r = generate(base, 20, num_predict=-1, num_ctx=4096)
    assert r.status_code == 200
    done = r.json()
    used = done["prompt_eval_count"] + done["eval_count"]
    assert used <= NUM_CTX
    if done["done_reason"] == "length":
        assert used == NUM_CTX


def test_a_narrower_num_ctx_narrows_the_row(base: str) -> None:
    r = generate(base, 40, num_ctx=32)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] == 32 - 32 // 4  # room for a quarter: no num_predict
    r = generate(base, 20, num_predict=-1, num_ctx=32)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["prompt_eval_count"] == 20
    assert done["prompt_eval_count"] + done["eval_count"] <= 32
