"""From tokens to `tool_calls`, per template family, streamed and whole, on both APIs."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer
from tests.tools.conftest import CALL_ARGS, WEATHER

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# model: the content that surrounds its call
FAMILIES = {
    "qwen3-tools": "Let me check. ",
    "qwen25-tools": "",
    "llama3-tools": "",
    "llama3-json": "",
    "mistral-tools": "",
    "generic-tools": "",
}


@pytest.fixture(scope="module")
def http(server: RunningServer) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=120)


def ollama_stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/api/chat", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("model", list(FAMILIES))
def test_ollama_chat_parses_the_call(http: httpx.Client, model: str) -> None:
    r = http.post(
        "/api/chat", json={"model": model, "messages": USER, "tools": [WEATHER], "stream": False}
    )
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    assert message["content"] == FAMILIES[model]
    [call] = message["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": CALL_ARGS}
    assert call["id"].startswith("call_") and len(call["id"]) == 13
    assert r.json()["done_reason"] == "stop"


@pytest.mark.parametrize("model", list(FAMILIES))
def test_ollama_chat_stream_sends_the_call_whole(http: httpx.Client, model: str) -> None:
    lines = ollama_stream(http, {"model": model, "messages": USER, "tools": [WEATHER]})
    assert lines[-1]["done"] is True
    content = "".join(line["message"]["content"] for line in lines)
    assert content == FAMILIES[model]
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [CALL_ARGS]
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"'):
        assert marker not in content


@pytest.mark.parametrize("model", list(FAMILIES))
def test_tools_reach_the_prompt(http: httpx.Client, model: str) -> None:
    def prompt_tokens(**extra: Any) -> int:
        body = {"model": model, "messages": USER, "stream": False, **extra}
        r = http.post("/api/chat", json=body)
        assert r.status_code == 200, r.text
        return int(r.json()["prompt_eval_count"])

    assert prompt_tokens(tools=[WEATHER]) > prompt_tokens() + 20


@pytest.mark.parametrize("model", list(FAMILIES))
def test_openai_chat_parses_the_call(http: httpx.Client, model: str) -> None:
    body = {"model": model, "messages": USER, "tools": [WEATHER]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL_ARGS
    assert (choice["message"]["content"] or "") == FAMILIES[model]


def test_show_reports_tools_and_thinking_from_the_template(http: httpx.Client) -> None:
    def caps(model: str) -> set[str]:
        r = http.post("/api/show", json={"model": model})
        assert r.status_code == 200
        return set(r.json()["capabilities"])

    for model in FAMILIES:
        assert "tools" in caps(model)
        assert ("thinking" in caps(model)) == (model == "qwen3-tools")
    assert {"tools", "thinking"} <= caps("qwen3-think")  # Qwen3's template has both
    assert "thinking" in caps("r1") and "tools" not in caps("r1")  # R1 never renders tools
    assert caps("tiny") == {"completion", "insert"}


def test_tools_on_a_model_without_them_are_a_400(http: httpx.Client) -> None:
    for path in ("/api/chat", "/v1/chat/completions"):
        body = {"model": "r1", "messages": USER, "tools": [WEATHER], "stream": False}
        r = http.post(path, json=body)
        assert r.status_code == 400
        assert "does not support tools" in r.text


def test_malformed_tools_are_a_400(http: httpx.Client) -> None:
    body = {"model": "qwen3-tools", "messages": USER, "tools": [{"type": "function"}]}
    r = http.post("/api/chat", json=body)
    assert r.status_code == 400 and "tools" in r.json()["error"]


MALFORMED = {
    "llama3-badjson": '{"name": "get_weather", "parameters": {"city": ',
    "generic-unknown": '{"name": "launch_rocket", "arguments": {}}',
}


@pytest.mark.parametrize("model", list(MALFORMED))
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_calls_come_back_as_content(http: httpx.Client, model: str, stream: bool) -> None:
    """Bad JSON, or a tool the request did not declare: the text is the answer, never a 500."""
    body = {"model": model, "messages": USER, "tools": [WEATHER]}
    if stream:
        lines = ollama_stream(http, body)
        content = "".join(line["message"]["content"] for line in lines)
        assert not any("tool_calls" in line["message"] for line in lines)
        assert lines[-1]["done"] is True and "error" not in lines[-1]
    else:
        r = http.post("/api/chat", json={**body, "stream": False})
        assert r.status_code == 200
        assert "tool_calls" not in r.json()["message"]
        content = r.json()["message"]["content"]
    assert content == MALFORMED[model]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["message"]["content"] == content


def test_without_tools_nothing_is_parsed(http: httpx.Client) -> None:
    r = http.post("/api/chat", json={"model": "qwen25-tools", "messages": USER, "stream": False})
    assert r.status_code == 200
    assert "tool_calls" not in r.json()["message"]
    assert "<tool_call>" in r.json()["message"]["content"]


def test_tool_results_are_rendered_for_mistral(http: httpx.Client) -> None:
    """Mistral's template refuses ids that are not 9 alphanumerics: Ollama's ids map to some."""
    first = http.post(
        "/api/chat",
        json={"model": "mistral-tools", "messages": USER, "tools": [WEATHER], "stream": False},
    ).json()["message"]
    history = [
        *USER,
        first,
        {"role": "tool", "content": "18", "tool_name": "get_weather",
         "tool_call_id": first["tool_calls"][0]["id"]},
    ]  # fmt: skip
    body = {"model": "mistral-tools", "messages": history, "tools": [WEATHER], "stream": False}
    r = http.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
