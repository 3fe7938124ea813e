"""/v1 on the wire: SSE framing, object fields, errors and failures mid-stream (plain httpx)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxd.engine.events import Event, Failed, GenerationRequest, TextChunk
from mlxd.engine.manager import Loaded
from tests.conftest import RunningServer, ServerThread

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def sse(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    out: list[Any] = []
    for event in events:
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def openai_error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def test_chat_stream_event_order(http: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse(http.post("/v1/chat/completions", json=body))
    *chunks, finish, usage, done = events
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for chunk in chunks[1:]:
        assert set(chunk["choices"][0]["delta"]) == {"content"}
    for obj in [*chunks, finish, usage]:
        assert re.fullmatch(r"chatcmpl-\d{1,3}", obj["id"])
        assert obj["object"] == "chat.completion.chunk"
        assert obj["model"] == "tiny"
        assert obj["system_fingerprint"] == "fp_ollama"
        assert obj["id"] == chunks[0]["id"] and obj["created"] == chunks[0]["created"]
    for chunk in chunks:
        assert chunk["choices"][0]["finish_reason"] is None
        assert "usage" not in chunk
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6


def test_stream_is_off_by_default(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 3}
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    out = r.json()
    assert re.fullmatch(r"chatcmpl-\d{1,3}", out["id"])
    assert set(out) == {
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
    }


def test_completions_stream_usage_on_every_chunk(http: httpx.Client) -> None:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    *chunks, finish, usage, done = sse(http.post("/v1/completions", json=body))
    assert done == "[DONE]"
    zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for obj in [*chunks, finish]:
        assert re.fullmatch(r"cmpl-\d{1,3}", obj["id"])
        assert obj["object"] == "text_completion"
        assert obj["usage"] == zero
    assert finish["choices"] == [{"text": "", "index": 0, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_completions_without_usage_and_system_prompt(http: httpx.Client) -> None:
    body = {"model": "sys", "prompt": "hello", "max_tokens": 3, "stream": True}
    events = sse(http.post("/v1/completions", json=body))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "[] is too short - 'messages'"),
        ("/v1/chat/completions", {"model": "tiny"}, 400, "[] is too short - 'messages'"),
        ("/v1/chat/completions", {"messages": MESSAGES}, 400, "model is required"),
        ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model 'nope' not found"),
        ("/v1/chat/completions", {"model": "bad name!", "messages": MESSAGES}, 400, "invalid model name"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
            400,
            "invalid json schema: Invalid type: wat",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
            400,
            "image URLs are not currently supported, please use base64 encoded data instead",
        ),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
            400,
            "invalid tool call arguments",
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "reasoning_effort": "huge"}, 400, "invalid reasoning value"),
        ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": "hot"}, 400, "invalid value for field 'temperature': expected number"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a", 1]}, 400, "invalid type for 'stop' field: int"),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "invalid value for field 'prompt': expected string"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model 'nope' not found"),
    ],
)  # fmt: skip
def test_errors_are_openai_shaped(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status
    assert r.json() == openai_error(status, message)


def test_bad_json_is_400(http: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"].startswith("invalid JSON")


def test_content_parts_and_text_response_format(http: httpx.Client) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
    ]  # fmt: skip
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 3,
        "response_format": {"type": "text"},
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_message_of_no_parts_is_an_empty_message(http: httpx.Client) -> None:
    """`content: []` keeps its turn (as `content: ""` would), rather than vanishing from the
    prompt with whatever it carried."""

    def prompt_tokens(content: Any) -> int:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 1}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    assert prompt_tokens([]) == prompt_tokens("")


def test_unknown_model_retrieve_and_v1_models_shape(http: httpx.Client) -> None:
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json() == openai_error(404, "model 'nope' not found")
    assert http.get("/v1/models/").status_code == 404
    namespaced = http.get("/v1/models/me/missing:tag")
    assert namespaced.json() == openai_error(404, "model 'me/missing:tag' not found")
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list"
    for m in listing["data"]:
        assert set(m) == {"id", "object", "created", "owned_by"}
        assert isinstance(m["created"], int)


# -- failures mid-stream ------------------------------------------------------------------------


def _fail_after_one_chunk(kind: str) -> Any:
    async def generate(slot: Loaded, request: GenerationRequest) -> AsyncIterator[Event]:
        yield TextChunk("partial")
        if kind == "raise":
            raise RuntimeError("boom")
        yield Failed("engine exploded")

    return generate


@pytest.fixture
def broken(registry_file: Path) -> Iterator[tuple[ServerThread, RunningServer]]:
    thread = ServerThread(registry_file)
    with thread as info:
        yield thread, info


@pytest.mark.parametrize(("kind", "message"), [("raise", "boom"), ("failed", "engine exploded")])
def test_failure_mid_stream_ends_with_error_event(
    broken: tuple[ServerThread, RunningServer],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    message: str,
) -> None:
    thread, info = broken
    manager = thread.state.manager
    monkeypatch.setattr(manager, "generate", _fail_after_one_chunk(kind))
    with httpx.Client(base_url=info.base_url, timeout=60) as http:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": True}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        first, error = sse(r)
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "partial"}
        assert error == openai_error(500, message)

        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        assert sse(r)[-1] == openai_error(500, message)

        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 500
        assert r.json() == openai_error(500, message)

    client = openai.OpenAI(base_url=info.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.APIError, match=message):
        list(stream)
    assert all(slot.users == 0 for slot in manager.loaded().values())
