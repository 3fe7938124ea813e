"""Ollama's wire contract checked with plain httpx: statuses, bodies, NDJSON, losslessness."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, ServerThread

RFC3339_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z$")
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 8}
SPEC_FIELDS = (
    "draft_method",
    "draft_count",
    "draft_accepted",
    "draft_acceptance_rate",
    "draft_tokens_per_round",
    "draft_acceptance_by_position",
    "draft_filled",
    "draft_filled_accepted",
)


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> str:
    """The `error` string of an Ollama error body with the given status."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert isinstance(body["error"], str)
    return str(body["error"])


def gen(http: httpx.Client, **body: Any) -> dict[str, Any]:
    body.setdefault("stream", False)
    r = http.post("/api/generate", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


# -- simple routes ---------------------------------------------------------------------------


def test_root(http: httpx.Client) -> None:
    r = http.get("/")
    assert r.status_code == 200
    assert r.text == "Ollama is running"
    assert r.headers["content-type"].startswith("text/plain")


def test_head_root(http: httpx.Client) -> None:
    r = http.head("/")
    assert r.status_code == 200
    assert r.content == b""


def test_version(http: httpx.Client) -> None:
    r = http.get("/api/version")
    assert r.status_code == 200
    version = r.json()["version"]
    assert re.match(r"^\d+\.\d+\.\d+", version)
    assert http.head("/api/version").status_code == 200


def test_tags_shape(http: httpx.Client) -> None:
    r = http.get("/api/tags")
    assert r.status_code == 200
    models = r.json()["models"]
    names = {m["name"] for m in models}
    assert {"tiny:latest", "pair:latest", "selfdraft:latest", "sys:latest"} <= names
    for m in models:
        assert m["name"] == m["model"]
        assert re.fullmatch(r"[0-9a-f]{64}", m["digest"])
        assert RFC3339_Z.match(m["modified_at"])
        assert isinstance(m["size"], int) and m["size"] > 0
        for key in (
            "parent_model",
            "format",
            "family",
            "families",
            "parameter_size",
            "quantization_level",
        ):
            assert key in m["details"]


@pytest.mark.parametrize("path", ["/nope", "/api/nope", "/api/generate/extra"])
def test_unknown_path_is_404_text(http: httpx.Client, path: str) -> None:
    r = http.get(path)
    assert r.status_code == 404
    assert r.text == "404 page not found"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/generate"),
        ("GET", "/api/chat"),
        ("GET", "/api/show"),
        ("POST", "/api/tags"),
        ("DELETE", "/"),
    ],
)
def test_wrong_method_is_405(http: httpx.Client, method: str, path: str) -> None:
    assert http.request(method, path).status_code == 405


# -- malformed requests ----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show"])
def test_malformed_json_is_400(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=b'{"model": "tiny",', headers={"content-type": "application/json"})
    assert error_of(r, 400)


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show"])
@pytest.mark.parametrize("content", [b"", b"  \n"])
def test_empty_body_is_400(http: httpx.Client, path: str, content: bytes) -> None:
    assert error_of(http.post(path, content=content), 400) == "missing request body"


@pytest.mark.parametrize("content", [b'["tiny"]', b'"tiny"', b"42", b"null"])
def test_body_not_an_object_is_400(http: httpx.Client, content: bytes) -> None:
    assert error_of(http.post("/api/generate", content=content), 400)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "options": "fast"}, "options"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "raw": "no"}, "raw"),
        ({"prompt": "x", "system": 1}, "system"),
        ({"prompt": "x", "context": "1,2"}, "context"),
        ({"prompt": "x", "options": {"temperature": "hot"}}, "temperature"),
        ({"prompt": "x", "options": {"num_predict": "8"}}, "num_predict"),
        ({"prompt": "x", "options": {"stop": 3}}, "stop"),
    ],
)
def test_wrong_field_types_are_400(http: httpx.Client, body: dict[str, Any], named: str) -> None:
    message = error_of(http.post("/api/generate", json={"model": "tiny", **body}), 400)
    assert named in message


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "no"}, "stream"),
        ({"messages": [{"role": "user", "content": "x"}], "options": {"top_k": "many"}}, "top_k"),
    ],
)
def test_chat_wrong_field_types_are_400(
    http: httpx.Client, body: dict[str, Any], named: str
) -> None:
    message = error_of(http.post("/api/chat", json={"model": "tiny", **body}), 400)
    assert named in message


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/generate", 404, "model 'bad name!' not found"),
        ("/api/chat", 400, "model is required"),
        ("/api/show", 400, "invalid model name"),
    ],
)
def test_an_invalid_model_name_is_answered_as_each_route_of_ollama_answers_it(
    http: httpx.Client, path: str, status: int, message: str
) -> None:
    body = {"model": "bad name!", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    assert error_of(http.post(path, json=body), status) == message


@pytest.mark.parametrize("path", ["/api/embed", "/api/embeddings"])
def test_embedding_routes_word_an_unknown_model_as_ollama_does(
    http: httpx.Client, path: str
) -> None:
    body = {"model": "nope", "input": "hi", "prompt": "hi"}
    assert (
        error_of(http.post(path, json=body), 404) == 'model "nope" not found, try pulling it first'
    )


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"model": "", "prompt": "hi"}])
def test_generate_missing_model_is_404(http: httpx.Client, body: dict[str, Any]) -> None:
    assert error_of(http.post("/api/generate", json=body), 404) == "model '' not found"


@pytest.mark.parametrize("body", [{"messages": []}, {"model": "", "messages": []}])
def test_chat_missing_model_is_400(http: httpx.Client, body: dict[str, Any]) -> None:
    assert error_of(http.post("/api/chat", json=body), 400) == "model is required"


def test_show_missing_model_is_400(http: httpx.Client) -> None:
    assert error_of(http.post("/api/show", json={}), 400) == "model is required"


def test_unknown_model_is_404_with_the_name_as_sent(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "nope", "prompt": "hi"})
    assert error_of(r, 404) == "model 'nope' not found"
    r = http.post(
        "/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert error_of(r, 404) == "model 'nope' not found"


def test_show_unknown_model_reports_normalized_name(http: httpx.Client) -> None:
    assert (
        error_of(http.post("/api/show", json={"model": "nope"}), 404)
        == "model 'nope:latest' not found"
    )


def test_invalid_role_is_400(http: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}
    assert "role" in error_of(http.post("/api/chat", json=body), 400)


def test_role_is_lower_cased(http: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "USER", "content": "x"}],
        "stream": False,
        "options": GREEDY,
    }
    lower = {**body, "messages": [{"role": "user", "content": "x"}]}
    a = http.post("/api/chat", json=body)
    b = http.post("/api/chat", json=lower)
    assert a.status_code == 200 and b.status_code == 200
    assert a.json()["message"]["content"] == b.json()["message"]["content"]


def test_raw_with_template_system_or_context_is_400(http: httpx.Client) -> None:
    for extra in ({"system": "s"}, {"template": "{{ .Prompt }}"}, {"context": [1, 2]}):
        r = http.post("/api/generate", json={"model": "tiny", "prompt": "x", "raw": True, **extra})
        assert error_of(r, 400) == "raw mode does not support template, system, or context"


def test_think_false_is_always_accepted(http: httpx.Client) -> None:
    r = gen(http, model="tiny", prompt="x", think=False, options=GREEDY)
    assert r["done"] is True


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_think_true_without_thinking_capability_is_400(http: httpx.Client, path: str) -> None:
    body = {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    r = http.post(path, json={**body, "think": True, "stream": False, "options": GREEDY})
    assert "does not support thinking" in error_of(r, 400)


def test_invalid_think_value_is_400(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "x", "think": "bogus"})
    assert error_of(r, 400) == "invalid think value"


# -- keep_alive ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["3600", "10", "1.5"])
def test_keep_alive_bare_numeric_string_is_400(http: httpx.Client, value: str) -> None:
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": value})
    assert "missing unit" in error_of(r, 400)


@pytest.mark.parametrize("value", ["5m", "1h30m", 10, 2.5, -1, "-1m", "300s"])
def test_keep_alive_accepted(http: httpx.Client, value: Any) -> None:
    r = gen(http, model="tiny", prompt="x", keep_alive=value, options={"num_predict": 2})
    assert r["done"] is True and r["eval_count"] == 2


def test_keep_alive_wrong_type_is_400(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": [1]})
    assert error_of(r, 400)


# -- streaming -------------------------------------------------------------------------------


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].split(";")[0].strip() == "application/x-ndjson"
    raw = response.content.decode("utf-8")
    assert raw.endswith("\n")
    lines = raw.split("\n")[:-1]
    objects = []
    for line in lines:
        assert line, "an empty NDJSON line"
        obj = json.loads(line)
        assert isinstance(obj, dict)
        objects.append(obj)
    return objects


def test_generate_ndjson_stream(http: httpx.Client) -> None:
    # `stream` absent means streaming
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "Hello", "options": GREEDY})
    objects = ndjson(r)
    assert len(objects) >= 2
    for obj in objects:
        assert obj["model"] == "tiny"
        assert isinstance(obj["response"], str)
        assert RFC3339_Z.match(obj["created_at"]), obj["created_at"]
        assert "error" not in obj
    assert all(o["done"] is False for o in objects[:-1])
    for o in objects[:-1]:
        assert "eval_count" not in o and "done_reason" not in o and "context" not in o
    final = objects[-1]
    assert final["done"] is True and final["done_reason"] == "length"
    assert final["response"] == ""
    assert final["eval_count"] == GREEDY["num_predict"]
    assert isinstance(final["context"], list)

    whole = gen(http, model="tiny", prompt="Hello", options=GREEDY)
    assert "".join(o["response"] for o in objects) == whole["response"]


def test_chat_ndjson_stream(http: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "options": GREEDY}
    objects = ndjson(http.post("/api/chat", json=body))
    for obj in objects:
        assert obj["model"] == "tiny"
        assert obj["message"]["role"] == "assistant"
        assert isinstance(obj["message"]["content"], str)
        assert RFC3339_Z.match(obj["created_at"])
    final = objects[-1]
    assert final["done"] is True and final["done_reason"] == "length"
    assert "context" not in final
    whole = http.post("/api/chat", json={**body, "stream": False}).json()
    assert "".join(o["message"]["content"] for o in objects) == whole["message"]["content"]


def test_stream_explicit_true_and_null(http: httpx.Client) -> None:
    for stream in (True, None):
        body = {"model": "tiny", "prompt": "Hi", "options": GREEDY, "stream": stream}
        objects = ndjson(http.post("/api/generate", json=body))
        assert objects[-1]["done"] is True


def test_stream_false_is_one_json_object(http: httpx.Client) -> None:
    r = http.post(
        "/api/generate", json={"model": "tiny", "prompt": "Hi", "options": GREEDY, "stream": False}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    obj = r.json()
    assert obj["done"] is True and obj["response"]
    assert RFC3339_Z.match(obj["created_at"])
    for key in (
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    ):
        assert isinstance(obj[key], int) and obj[key] >= 0


def test_load_and_unload_objects(http: httpx.Client) -> None:
    r = gen(http, model="pair", prompt="")
    assert r["done"] is True and r["done_reason"] == "load" and r["response"] == ""
    assert RFC3339_Z.match(r["created_at"])
    r = gen(http, model="pair", prompt="", keep_alive=0)
    assert r["done_reason"] == "unload"
    r = http.post("/api/chat", json={"model": "pair", "messages": [], "stream": False}).json()
    assert r["done_reason"] == "load" and r["message"] == {"role": "assistant", "content": ""}
    r = http.post(
        "/api/chat", json={"model": "pair", "messages": [], "keep_alive": 0, "stream": False}
    ).json()
    assert r["done_reason"] == "unload"


def test_unknown_options_are_ignored(http: httpx.Client) -> None:
    opts = {
        "temperature": 0,
        "num_predict": 3,
        "bogus": 1,
        "mirostat": 2,
        "numa": True,
        "tfs_z": 1.0,
    }
    r = gen(http, model="tiny", prompt="Hi", options=opts)
    assert r["eval_count"] == 3
    plain = gen(http, model="tiny", prompt="Hi", options={"temperature": 0, "num_predict": 3})
    assert r["response"] == plain["response"]


def test_show_accepts_name(http: httpx.Client) -> None:
    a = http.post("/api/show", json={"name": "tiny"})
    b = http.post("/api/show", json={"model": "tiny"})
    assert a.status_code == 200 and b.status_code == 200
    assert a.json()["model_info"] == b.json()["model_info"]
    assert "model_info" in a.json() and "capabilities" in a.json()


def test_show_draft_pairing(http: httpx.Client) -> None:
    r = http.post("/api/show", json={"model": "pair"}).json()
    assert "draft" in r
    assert "DRAFT " in r["modelfile"]


# -- speculation -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["pair", "selfdraft"])
def test_speculation_fields_on_final_object(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": "def f(x):", "options": {"temperature": 0, "num_predict": 16}}
    objects = ndjson(http.post("/api/generate", json=body))
    final = objects[-1]
    for key in SPEC_FIELDS:
        assert key in final, key
    assert final["draft_method"] in ("auto", "model", "lookup")
    assert 0.0 <= final["draft_acceptance_rate"] <= 1.0
    assert isinstance(final["draft_acceptance_by_position"], list)
    assert 0 <= final["draft_filled_accepted"] <= final["draft_filled"]
    for o in objects[:-1]:
        assert not any(key in o for key in SPEC_FIELDS)
    whole = gen(http, **body)
    for key in SPEC_FIELDS:
        assert key in whole, key


def test_speculation_off_reports_off(http: httpx.Client) -> None:
    r = gen(http, model="pair", prompt="hi", options={**GREEDY, "draft_method": "off"})
    assert r["draft_method"] == "off"
    assert "draft_acceptance_rate" not in r


def test_invalid_draft_method_is_400(http: httpx.Client) -> None:
    r = http.post(
        "/api/generate", json={"model": "pair", "prompt": "x", "options": {"draft_method": "magic"}}
    )
    assert "draft_method" in error_of(r, 400)


SELF_DRAFT_PROMPTS = ("def f(x):", "The weather today", "Why is the sky blue?", "Once upon a time")


def test_self_draft_model_is_accepted(http: httpx.Client) -> None:
    """Drafting with the target itself at temperature 0: (nearly) every draft is accepted. (On
    this CPU self-drafting never pays, so the pairing's pause clock lets only some of these
    requests run trial rounds: 4 x 96 tokens outlast its first pauses of 64 and 128.)"""
    drafted = 0
    for prompt in SELF_DRAFT_PROMPTS:
        r = gen(
            http, model="selfdraft", prompt=prompt,
            options={"temperature": 0, "num_predict": 96, "draft_method": "model"},
        )  # fmt: skip
        assert r["draft_method"] == "model"
        if r["draft_count"]:
            drafted += r["draft_count"]
            assert r["draft_acceptance_rate"] > 0.9, r
    assert drafted > 0


def test_self_draft_auto_is_accepted(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (`auto`) for selfdraft, on prompts where prompt lookup never proposes.

    `auto` prefers a prompt-lookup draft when one is found, and those can be rejected; which
    round finds one depends on the (timed) draft length, so only lookup-free prompts give a
    deterministic check. The tokenizer is trained per interpreter, so they are picked here.
    """
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")  # a self-draft never pays: pinned is acceptance
    greedy = {"temperature": 0, "num_predict": 24}
    clean = []
    for prompt in SELF_DRAFT_PROMPTS:
        probe = gen(
            http, model="selfdraft", prompt=prompt,
            options={**greedy, "draft_method": "lookup", "draft_num_predict": 1},
        )  # fmt: skip
        if probe["draft_count"] == 0:
            clean.append(prompt)
    assert len(clean) >= 2, "candidate prompts repeat themselves; add others"
    drafted = 0
    for prompt in clean:  # once the model arm stops paying, the clock runs the lookup arm
        r = gen(http, model="selfdraft", prompt=prompt, options=greedy)
        assert r["draft_method"] == "auto"
        if r["draft_count"]:
            drafted += r["draft_count"]
            assert r["draft_acceptance_rate"] > 0.9, r
    assert drafted > 0


LOSSLESS_CASES: list[tuple[str, dict[str, Any]]] = [
    ("tiny", {}),
    ("tiny", {"draft_method": "lookup"}),
    ("pair", {}),
    ("pair", {"draft_method": "lookup"}),
    ("pair", {"draft_method": "off"}),
    ("pair", {"draft_method": "model"}),
    ("pair", {"draft_method": "model", "draft_num_predict": 8}),
    ("selfdraft", {}),
    ("selfdraft", {"draft_method": "model"}),
    ("selfdraft", {"draft_method": "lookup"}),
    ("selfdraft", {"draft_num_predict": 2}),
]


@pytest.mark.parametrize(
    "prompt",
    ["def fib(n):\n    if n < 2:", "Hello, world! Hello, world! Hello,", "Why is the sky blue?"],
)
def test_speculation_is_lossless(http: httpx.Client, prompt: str) -> None:
    """Greedy output is token-identical with and without speculation, whatever drafts it."""
    base_opts = {"temperature": 0, "num_predict": 24}
    base = gen(http, model="tiny", prompt=prompt, options={**base_opts, "draft_method": "off"})
    assert base["draft_method"] == "off"
    for model, extra in LOSSLESS_CASES:
        r = gen(http, model=model, prompt=prompt, options={**base_opts, **extra})
        where = f"{model} {extra}"
        assert r["context"] == base["context"], where
        assert r["response"] == base["response"], where
        assert r["eval_count"] == base["eval_count"], where


def test_speculation_is_lossless_in_chat_streams(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Count: one two three"}], "stream": True}
    texts = set()
    for model, extra in [
        ("tiny", {"draft_method": "off"}),
        ("pair", {}),
        ("selfdraft", {"draft_method": "model"}),
    ]:
        opts = {"temperature": 0, "num_predict": 20, **extra}
        objects = ndjson(http.post("/api/chat", json={**body, "model": model, "options": opts}))
        texts.add("".join(o["message"]["content"] for o in objects))
    assert len(texts) == 1


# -- a client that goes away -----------------------------------------------------------------


def test_client_disconnect_mid_stream(http: httpx.Client, server: RunningServer) -> None:
    before = gen(http, model="tiny", prompt="after", options=GREEDY)
    with httpx.Client(base_url=server.base_url, timeout=120) as other:
        body = {
            "model": "tiny",
            "prompt": "Tell me everything",
            "options": {"temperature": 0, "num_predict": 1500},
        }
        with other.stream("POST", "/api/generate", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first, second = next(lines), next(lines)
            assert json.loads(first)["done"] is False and json.loads(second)["done"] is False
    after = gen(http, model="tiny", prompt="after", options=GREEDY)
    assert after["response"] == before["response"]
    assert http.get("/").text == "Ollama is running"


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_body_is_no_server_error(
    server: RunningServer, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request whose body stops arriving (the client closed the connection) is a client
    gone, not a failure of the server: nothing is logged as an error, and the next request is
    served."""
    with (
        caplog.at_level(logging.WARNING),
        socket.create_connection((server.host, server.port)) as sock,
    ):
        head = f"POST {path} HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json"
        sock.sendall(f'{head}\r\nContent-Length: 100\r\n\r\n{{"model": "tiny"'.encode())
        time.sleep(0.3)  # the server is reading the body when the client goes
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.get("/").text == "Ollama is running"
    time.sleep(0.3)  # the server noticed the closed connection by now
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_disconnect_releases_the_model(registry_file: Path) -> None:
    """After a dropped stream the model is idle again (so keep_alive and unload still work)."""
    thread = ServerThread(registry_file)
    with thread as info, httpx.Client(base_url=info.base_url, timeout=120) as http:
        body = {
            "model": "tiny",
            "prompt": "Tell me everything",
            "options": {"temperature": 0, "num_predict": 1500},
        }
        with http.stream("POST", "/api/generate", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
        deadline = time.monotonic() + 30  # a generous bound on cleanup, not a speed check
        slot = thread.state.manager.loaded()["tiny:latest"]
        while (slot.users or slot.runner.busy) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slot.users == 0
        assert not slot.runner.busy
        r2 = http.post(
            "/api/generate", json={"model": "tiny", "prompt": "", "keep_alive": 0, "stream": False}
        )
        assert r2.json()["done_reason"] == "unload"
        assert "tiny:latest" not in thread.state.manager.loaded()
