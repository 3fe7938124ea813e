"""No input reaches a 500: malformed, hostile and out-of-range requests get a 400 (or 413) with
a JSON error body, and the same keep-alive connection serves the next request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, ServerThread

GOOD: dict[str, dict[str, Any]] = {
    "/api/generate": {"model": "tiny", "prompt": "hi", "stream": False},
    "/api/chat": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
    },
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "tiny", "prompt": "hi"},
}
FEW = {"num_predict": 2, "temperature": 0}


def good_body(path: str) -> dict[str, Any]:
    body = dict(GOOD[path])
    if path.startswith("/api/"):
        body["options"] = FEW
    else:
        body["max_tokens"] = 2
    return body


def raw_body(path: str, **replace: str) -> bytes:
    """A good request's JSON with some values replaced by raw JSON text (invalid or huge)."""
    body = good_body(path)
    marks = {key: f"@@{key}@@" for key in replace}
    for key, mark in marks.items():
        body[key] = mark
    text = json.dumps(body)
    for key, mark in marks.items():
        text = text.replace(json.dumps(mark), replace[key])
    return text.encode()


def error_of(r: httpx.Response, status: int) -> str:
    """The message of an error body in Ollama's or OpenAI's shape, with the given status."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    return str(error["message"] if isinstance(error, dict) else error)


def local_port(r: httpx.Response) -> int:
    """The client-side port of the connection that carried `r` (same port: same connection)."""
    stream = r.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def bad_then_good(http: httpx.Client, path: str, content: bytes, status: int = 400) -> str:
    """Send the bad body, then a good one on the same keep-alive connection; the error text."""
    bad = http.post(path, content=content, headers={"content-type": "application/json"})
    message = error_of(bad, status)
    good = http.post(path, json=good_body(path))
    assert good.status_code == 200, good.text
    assert local_port(good) == local_port(bad), "the error closed the keep-alive connection"
    return message


PATHS = list(GOOD)
DEEP = "[" * 1000 + "]" * 1000
HUGE_INT = "9" * 5000


def _text_field(path: str) -> str:
    return "prompt" if path in ("/api/generate", "/v1/completions") else "messages"


def _text_value(path: str, raw_text: str) -> str:
    """Raw JSON for the prompt (or one user message) holding `raw_text` as a JSON string body."""
    if _text_field(path) == "prompt":
        return f'"{raw_text}"'
    return f'[{{"role": "user", "content": "{raw_text}"}}]'


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("surrogate", ["\\ud800", "\\udc00", "a\\ud800b", "\\ud800\\ud800"])
def test_lone_surrogates_are_400(http: httpx.Client, path: str, surrogate: str) -> None:
    field = _text_field(path)
    body = raw_body(path, **{field: _text_value(path, surrogate)})
    assert "JSON" in bad_then_good(http, path, body)


@pytest.mark.parametrize("path", PATHS)
def test_a_paired_surrogate_escape_is_text(http: httpx.Client, path: str) -> None:
    field = _text_field(path)
    r = http.post(path, content=raw_body(path, **{field: _text_value(path, "\\ud83d\\ude00")}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["top", "options", "tools"])
def test_deep_nesting_is_400(http: httpx.Client, path: str, where: str) -> None:
    if where == "top":
        content = (DEEP[:1000] + json.dumps(good_body(path)) + DEEP[1000:]).encode()
    elif where == "options":
        content = raw_body(path, options=f'{{"stop": {DEEP}}}')
    else:
        content = raw_body(path, tools=DEEP)
    bad_then_good(http, path, content)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("option", ["seed", "num_predict", "top_k", "temperature", "bogus"])
def test_integers_over_4300_digits_are_400(http: httpx.Client, path: str, option: str) -> None:
    content = raw_body(path, options=f'{{"{option}": {HUGE_INT}}}')
    assert "options" in bad_then_good(http, path, content)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("key", ["seed", "max_tokens", "temperature"])
def test_openai_integers_over_4300_digits_are_400(http: httpx.Client, path: str, key: str) -> None:
    assert key in bad_then_good(http, path, raw_body(path, **{key: HUGE_INT}))


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("option", ["num_predict", "top_k", "seed", "temperature"])
def test_nan_and_infinity_in_options_are_400(
    http: httpx.Client, path: str, literal: str, option: str
) -> None:
    bad_then_good(http, path, raw_body(path, options=f'{{"{option}": {literal}}}'))


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
@pytest.mark.parametrize("literal", ["NaN", "1e999", "1e18", "-1e400", '"99999999999h"'])
def test_keep_alive_out_of_range_is_400(http: httpx.Client, path: str, literal: str) -> None:
    bad_then_good(http, path, raw_body(path, keep_alive=literal))
    assert http.get("/api/ps").status_code == 200
    assert http.get("/api/mlxd/stats").status_code == 200


@pytest.mark.parametrize("value", [2**64, 2**63, -(2**63) - 1])
def test_seed_outside_64_bits_is_400(http: httpx.Client, value: int) -> None:
    path = "/api/generate"
    message = bad_then_good(http, path, raw_body(path, options=f'{{"seed": {value}}}'))
    assert "seed" in message
    path = "/v1/chat/completions"
    assert "seed" in bad_then_good(http, path, raw_body(path, seed=str(value)))


def test_seed_at_the_64_bit_edges_works(http: httpx.Client) -> None:
    for seed in (2**63 - 1, -(2**63), -1):
        body = {**good_body("/api/generate"), "options": {**FEW, "seed": seed}}
        r = http.post("/api/generate", json=body)
        assert r.status_code == 200, r.text


OPTION_BOUNDS: list[tuple[str, Any]] = [
    ("min_p", 5),
    ("min_p", -0.1),
    ("repeat_penalty", 0),
    ("repeat_penalty", -1),
    ("temperature", 1000),
    ("num_predict", 2**40),
    ("num_predict", -3),
    ("repeat_last_n", -2),
    ("draft_num_predict", 65),
    ("draft_num_predict", 10**6),
    ("draft_num_predict", -1),
    ("presence_penalty", 1e6),
    ("kv_bits", 3),
    ("kv_group_size", 48),
    ("quantized_kv_start", -1),
    ("num_ctx", 2**40),
]


@pytest.mark.parametrize(("option", "value"), OPTION_BOUNDS)
def test_options_out_of_range_are_400(http: httpx.Client, option: str, value: Any) -> None:
    for path in ("/api/generate", "/api/chat"):
        content = json.dumps({**good_body(path), "options": {**FEW, option: value}}).encode()
        assert option in bad_then_good(http, path, content)


@pytest.mark.parametrize(
    ("key", "value"), [("temperature", 1e9), ("temperature", 101), ("max_tokens", -5)]
)
def test_openai_fields_out_of_range_are_400(http: httpx.Client, key: str, value: Any) -> None:
    path = "/v1/chat/completions"
    bad_then_good(http, path, json.dumps({**good_body(path), key: value}).encode())


WRONG_TYPES: list[tuple[str, dict[str, Any], str]] = [
    ("/api/generate", {"model": 5}, "model"),
    ("/api/generate", {"suffix": ["x"]}, "suffix"),
    ("/api/generate", {"template": {}}, "template"),
    ("/api/generate", {"context": [1, "2"]}, "context"),
    ("/api/generate", {"context": [1, True]}, "context"),
    ("/api/generate", {"keep_alive": {"s": 1}}, "keep_alive"),
    ("/api/generate", {"keep_alive": True}, "keep_alive"),
    ("/api/generate", {"think": 3}, "think"),
    ("/api/generate", {"images": "x"}, "images"),
    ("/api/chat", {"messages": [5]}, "messages[0]"),
    ("/api/chat", {"messages": [{"role": ["user"], "content": "x"}]}, "role"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [1]}]}, "tool_calls"),
    ("/api/chat", {"tools": {"a": 1}}, "tools"),
    ("/api/chat", {"options": {"stop": [1]}}, "stop"),
    ("/api/chat", {"options": {"draft_method": 5}}, "draft_method"),
    ("/api/chat", {"options": []}, "options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]}, "message format"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": "yes"}}, "include_usage"),
    ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
    ("/v1/chat/completions", {"reasoning": {"effort": 1}}, "effort"),
    ("/v1/chat/completions", {"max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {"stop": {"a": 1}}, "stop"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "[" * 5000}}]}]},
        "arguments",
    ),
    ("/v1/completions", {"suffix": 5}, "suffix"),
    ("/v1/completions", {"seed": "1"}, "seed"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "change", "named"), WRONG_TYPES)
def test_wrong_types_everywhere_are_400(
    http: httpx.Client, path: str, change: dict[str, Any], named: str
) -> None:
    content = json.dumps({**good_body(path), **change}).encode()
    assert named in bad_then_good(http, path, content)


@pytest.mark.parametrize("path", ["/api/show", "/api/pull", "/api/copy"])
@pytest.mark.parametrize("content", [b'{"model": 5, "name": 5, "source": 5}', b'"\\ud800"', b"[]"])
def test_model_routes_refuse_bad_bodies_with_400(
    http: httpx.Client, path: str, content: bytes
) -> None:
    error_of(http.post(path, content=content), 400)
    assert http.get("/api/version").status_code == 200


def test_delete_refuses_bad_bodies_with_400(http: httpx.Client) -> None:
    r = http.request("DELETE", "/api/delete", content=b'{"model": ["tiny"]}')
    assert "model" in error_of(r, 400)


def test_a_refused_delete_leaves_the_model_loaded(http: httpx.Client) -> None:
    """`tiny` comes from a registry file mlxd does not edit and points at local files: the
    delete is refused, and refused means no side effect (it used to unload the model first)."""
    assert http.post("/api/generate", json={"model": "tiny", "prompt": "x",
                     "stream": False, "options": {"num_predict": 1}}).status_code == 200  # fmt: skip
    assert "does not manage" in error_of(
        http.request("DELETE", "/api/delete", json={"model": "tiny"}), 400
    )
    assert "tiny:latest" in [m["name"] for m in http.get("/api/ps").json()["models"]]


def test_a_prompt_far_beyond_the_context_is_cut_not_refused(http: httpx.Client) -> None:
    """10 MB of text for a 2048-token context: only its ends are tokenized, and the answer
    comes from the head and the most recent tokens (as Ollama truncates)."""
    huge = "word " * (2 * 2**20)
    for path in ("/api/generate", "/v1/completions"):
        r = http.post(path, json={**good_body(path), "prompt": huge})
        assert r.status_code == 200, r.text
    r = http.post("/api/chat", json={**good_body("/api/chat"), "messages": [
        {"role": "user", "content": huge}
    ]})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] <= 2048
    r = http.post("/api/generate", json={**good_body("/api/generate"), "context": [1] * 4096})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] <= 2048


# -- the body limit -----------------------------------------------------------------------------

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small(registry_file: Path) -> Iterator[RunningServer]:
    with ServerThread(registry_file, max_body=LIMIT) as info:
        yield info


@pytest.mark.parametrize("path", PATHS)
def test_body_over_the_limit_is_413_by_content_length(small: RunningServer, path: str) -> None:
    with httpx.Client(base_url=small.base_url, timeout=120) as http:
        body = {**good_body(path), "prompt": "x" * LIMIT}
        message = bad_then_good(http, path, json.dumps(body).encode(), status=413)
        assert "too large" in message


@pytest.mark.parametrize("path", PATHS)
def test_chunked_body_over_the_limit_is_413_while_reading(small: RunningServer, path: str) -> None:
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * LIMIT // 4096):
            sent.append(4096)
            yield b"x" * 4096
        yield b'"}'

    with httpx.Client(base_url=small.base_url, timeout=120) as http:
        r = http.post(path, content=chunks())
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert "too large" in error_of(r, 413)
        good = http.post(path, json=good_body(path))
        assert good.status_code == 200, good.text


def test_body_at_the_limit_is_read(small: RunningServer) -> None:
    with httpx.Client(base_url=small.base_url, timeout=120) as http:
        text = json.dumps(good_body("/api/generate"))
        head, tail = text[:-1] + ', "pad": "', '"}'
        padded = head + "x" * (LIMIT - len(head) - len(tail)) + tail
        assert len(padded.encode()) == LIMIT
        r = http.post("/api/generate", content=padded.encode())
        assert r.status_code == 200, r.text


def test_kv_groups_that_do_not_divide_the_head_size_are_400(http: httpx.Client) -> None:
    """The tiny model's heads are 16 wide: 4-bit KV in groups of 64 cannot quantize them."""
    for path in ("/api/generate", "/api/chat"):
        options = {**FEW, "kv_bits": 4, "kv_group_size": 64}
        content = json.dumps({**good_body(path), "options": options}).encode()
        assert "head size" in bad_then_good(http, path, content)
