"""`logprobs` / `top_logprobs` in Ollama's and OpenAI's shapes, equal to the target's own
log-softmax at every committed position, with speculation or without."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import mlx.core as mx
import ollama
import openai
import pytest
from mlx_lm.utils import load

from mlxd.api.logprobs import TextOffsets, openai_completion_json
from mlxd.engine.logprobs import Logprob
from tests.conftest import RunningServer
from tests.fixtures.tiny_models import TinyPair

PROMPT = "def fibonacci(n):"
TOL = 2e-3  # float32 forwards of different widths (verify vs one token) round differently


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=180) as client:
        yield client


def generate(http: httpx.Client, model: str, **extra: Any) -> dict[str, Any]:
    options = {"temperature": 0, "num_predict": 12, **extra.pop("options", {})}
    body = {"model": model, "prompt": PROMPT, "stream": False, "options": options, **extra}
    r = http.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture(scope="module")
def reference(tiny_pair: TinyPair) -> Any:
    """The target's log-softmax over a token sequence, computed in one plain forward."""
    model, _ = load(str(tiny_pair.target))[:2]

    def logsoftmax(tokens: list[int]) -> list[list[float]]:
        logits = model(mx.array([tokens]))[0].astype(mx.float32)
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return rows.tolist()  # type: ignore[return-value]

    return logsoftmax


def check_exact(done: dict[str, Any], reference: Any, top: int) -> None:
    context = done["context"]
    n = done["prompt_eval_count"]
    out = context[n:]
    lps = done["logprobs"]
    assert len(lps) == len(out) == done["eval_count"] > 0
    rows = reference(context)
    for i, (tok, lp) in enumerate(zip(out, lps, strict=True)):
        row = rows[n - 1 + i]  # the distribution token n+i was chosen from
        assert math.isclose(lp["logprob"], row[tok], abs_tol=TOL)
        best = sorted(range(len(row)), key=lambda t: -row[t])[:top]
        assert [round(t["logprob"], 2) for t in lp["top_logprobs"]] == [
            round(row[t], 2) for t in best
        ]


def test_generate_logprobs_are_the_targets(http: httpx.Client, reference: Any) -> None:
    done = generate(http, "tiny", logprobs=True, top_logprobs=3, options={"draft_method": "off"})
    check_exact(done, reference, 3)
    lps = done["logprobs"]
    assert "".join(lp["token"] for lp in lps) == done["response"]
    # each token's own bytes: joined, they are the text (a split character's parts included)
    joined = bytes(b for lp in lps for b in lp["bytes"])
    assert joined.decode("utf-8", "replace") == done["response"]
    assert all(
        lp["bytes"] == list(lp["token"].encode()) for lp in lps if "\ufffd" not in lp["token"]
    )
    for lp in lps:  # greedy: the chosen token is the most likely one
        assert lp["top_logprobs"][0]["token"] == lp["token"]


@pytest.mark.parametrize("method", ["model", "lookup"])
def test_speculation_reports_the_targets_distribution(
    http: httpx.Client, reference: Any, method: str
) -> None:
    done = generate(
        http, "pair", logprobs=True, top_logprobs=2,
        options={"draft_method": method, "temperature": 0.9, "seed": 7},
    )  # fmt: skip
    check_exact(done, reference, 2)
    plain = generate(
        http, "tiny", logprobs=True, top_logprobs=2,
        options={"draft_method": "off", "temperature": 0.9, "seed": 7},
    )  # fmt: skip
    assert plain["context"] == done["context"]
    for a, b in zip(plain["logprobs"], done["logprobs"], strict=True):
        assert a["token"] == b["token"] and math.isclose(a["logprob"], b["logprob"], abs_tol=TOL)


def test_no_logprobs_unless_asked(http: httpx.Client) -> None:
    assert "logprobs" not in generate(http, "tiny")
    done = generate(http, "tiny", logprobs=True)
    assert done["logprobs"] and "top_logprobs" not in done["logprobs"][0]


def test_streamed_logprobs_add_up_to_the_whole(http: httpx.Client) -> None:
    whole = generate(http, "tiny", logprobs=True, top_logprobs=1)
    body = {"model": "tiny", "prompt": PROMPT, "logprobs": True, "top_logprobs": 1,
            "options": {"temperature": 0, "num_predict": 12}}  # fmt: skip
    with http.stream("POST", "/api/generate", json=body) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    streamed = [lp for c in chunks for lp in c.get("logprobs") or []]
    assert streamed == whole["logprobs"]


def test_chat_through_the_ollama_client(server: RunningServer) -> None:
    client = ollama.Client(host=server.base_url)
    out = client.chat(
        "tiny", [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
        options={"temperature": 0, "num_predict": 6},
    )  # fmt: skip
    assert out.logprobs is not None and len(out.logprobs) == out.eval_count
    assert all(lp.top_logprobs and len(lp.top_logprobs) == 2 for lp in out.logprobs)
    if out.message.content.isascii():  # a token inside a character reads as U+FFFD
        assert "".join(lp.token for lp in out.logprobs) == out.message.content


def test_top_logprobs_out_of_range_is_400(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "x", "top_logprobs": 21})
    assert r.status_code == 400
    assert r.json()["error"] == "top_logprobs must be between 0 and 20"


def test_openai_chat_and_completions(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, max_tokens=6,
        temperature=0,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    if (chat.choices[0].message.content or "").isascii():
        assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 for c in content)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, logprobs=True, top_logprobs=2, max_tokens=6,
        temperature=0, stream=True,
    )  # fmt: skip
    streamed = [c for ch in stream for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content or []]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in content]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None

    text = client.completions.create(
        model="tiny", prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0
    )
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens and len(lp.tokens) == len(lp.token_logprobs or [])
    offsets = lp.text_offset or []
    if text.choices[0].text.isascii():
        assert "".join(lp.tokens) == text.choices[0].text
        assert offsets == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert offsets == sorted(offsets) and all(o <= len(text.choices[0].text) for o in offsets)
    pieces = client.completions.create(
        model="tiny", prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0, stream=True
    )
    streamed_offsets = [o for p in pieces for c in p.choices if c.logprobs
                        for o in c.logprobs.text_offset or []]  # fmt: skip
    assert streamed_offsets == offsets
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs or [])  # keys: text, may collide


def test_batched_rows_report_the_targets_distribution(http: httpx.Client, reference: Any) -> None:
    """Four requests at once share batched rounds; each still gets its own exact values."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT, "class Stack:", "import os", "The quick brown"]

    def one(prompt: str) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "stream": False, "logprobs": True,
                "top_logprobs": 1, "options": {"temperature": 0, "num_predict": 24}}  # fmt: skip
        r = http.post("/api/generate", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())

    with ThreadPoolExecutor(4) as pool:
        for done in pool.map(one, prompts):
            check_exact(done, reference, 1)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_a_stop_string_cut_away_have_no_values(http: httpx.Client, stream: bool) -> None:
    """A reply cut by a stop string lists the values of the tokens it holds text of, as
    Ollama trims them after the cut: the stop's own token (and any after it) left its text
    out and its value in."""
    whole = generate(http, "tiny", logprobs=True)
    tokens = [lp["token"] for lp in whole["logprobs"]]
    at = next(
        i for i in range(2, len(tokens))
        if tokens[i].strip() and tokens[i].isascii() and tokens[i] not in "".join(tokens[:i])
    )  # fmt: skip
    body = {"model": "tiny", "prompt": PROMPT, "stream": stream, "logprobs": True,
            "options": {"temperature": 0, "num_predict": 12, "stop": [tokens[at]]}}  # fmt: skip
    lines = [json.loads(line) for line in http.post("/api/generate", json=body).text.splitlines()]
    response = "".join(line.get("response", "") for line in lines)
    values = [lp for line in lines for lp in line.get("logprobs") or []]
    assert response == "".join(tokens[:at])
    assert [lp["token"] for lp in values] == tokens[:at]
    text = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x").completions.create(
        model="tiny", prompt=PROMPT, logprobs=1, max_tokens=12, temperature=0, stop=[tokens[at]]
    )
    legacy = text.choices[0].logprobs
    assert legacy is not None and len(legacy.tokens or []) == at
    assert all(o < len(text.choices[0].text) for o in legacy.text_offset or [])


def test_legacy_alternatives_that_are_pieces_of_characters_are_keyed_by_their_bytes() -> None:
    """Tokens that are pieces of a character all read U+FFFD: keyed by their bytes (OpenAI's
    `bytes:` form) they are all listed, and text that reads alike keeps the likeliest value."""
    top = (
        Logprob("\ufffd", -1.0, (0xE6,)),
        Logprob("\ufffd", -2.0, (0xE7,)),
        Logprob("a", -3.0, (0x61,)),
        Logprob("a", -4.0, (0x61,)),
    )
    chosen = Logprob("\ufffd", -1.0, (0xE6,), top)
    legacy = openai_completion_json([chosen], TextOffsets(), "")
    assert legacy["tokens"] == ["bytes:\\xe6"]
    assert legacy["top_logprobs"] == [{"bytes:\\xe6": -1.0, "bytes:\\xe7": -2.0, "a": -3.0}]
