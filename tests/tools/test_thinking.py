"""Thinking: split into message.thinking (never content) for <think> models, including a
template that opens the block in the prompt; `think` and `reasoning_effort` honoured."""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.conftest import RunningServer
from tests.daemon.test_cli import err, mlxd, out
from tests.tools.conftest import BLUE, MUSED, THOUGHT, WEATHER

SKY: list[Any] = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


@pytest.mark.parametrize("think", [None, True, "high"])
def test_thinking_arrives_in_message_thinking(client: ollama.Client, think: Any) -> None:
    r = client.chat(model="qwen3-think", messages=SKY, think=think)
    assert r.message.thinking == THOUGHT
    assert r.message.content == BLUE


def test_thinking_stream_never_reaches_content(client: ollama.Client) -> None:
    parts = list(client.chat(model="qwen3-think", messages=SKY, think=True, stream=True))
    content = "".join(p.message.content or "" for p in parts)
    thinking = "".join(p.message.thinking or "" for p in parts)
    assert content == BLUE
    assert thinking == THOUGHT
    assert all("think>" not in (p.message.content or "") for p in parts)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_drafted_while_thinking_stays_thinking(client: ollama.Client, stream: bool) -> None:
    """With tools declared the reasoning still runs free: the model's `<tool_call>` token is
    not barred there, and what it drafts stays in the thinking, never run."""
    parts = client.chat(
        model="qwen3-muses", messages=SKY, tools=[WEATHER], think=True, stream=stream,
        options={"num_predict": 40},
    )  # fmt: skip
    parts = list(parts) if stream else [parts]
    assert "".join(p.message.content or "" for p in parts) == BLUE
    thinking = "".join(p.message.thinking or "" for p in parts)
    assert thinking == f"I might call <tool_call>{MUSED}</tool_call>\nno."
    assert not any(p.message.tool_calls for p in parts)
    assert parts[-1].done_reason == "stop"


def test_think_false_renders_the_switch_and_keeps_what_the_model_writes(
    client: ollama.Client,
) -> None:
    """Qwen3's template closes an empty think block when thinking is off; a model that thinks
    anyway keeps its words in the content, as Ollama does (nothing dropped silently)."""
    on = client.chat(model="qwen3-think", messages=SKY, think=True)
    off = client.chat(model="qwen3-think", messages=SKY, think=False)
    assert not off.message.thinking
    # `<think>\n\n</think>\n\n`: two tag tokens and four newlines more
    assert off.prompt_eval_count == (on.prompt_eval_count or 0) + 6
    assert THOUGHT in off.message.content and BLUE in off.message.content


def test_a_prompt_that_opens_the_block(client: ollama.Client) -> None:
    """R1 distills' template ends the prompt with `<think>\\n`: the output starts inside."""
    r = client.chat(model="r1", messages=[{"role": "user", "content": "2+2?"}])
    assert r.message.thinking == "Two plus two is four."
    assert r.message.content == "The answer is 4."
    parts = list(
        client.chat(model="r1", messages=[{"role": "user", "content": "2+2?"}], stream=True)
    )
    assert "".join(p.message.content or "" for p in parts) == "The answer is 4."


def test_generate_has_top_level_thinking(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.post("/api/generate", json={"model": "r1", "prompt": "2+2?", "stream": False})
        assert r.status_code == 200
        assert r.json()["thinking"] == "Two plus two is four."
        assert r.json()["response"] == "The answer is 4."
        with http.stream("POST", "/api/generate", json={"model": "r1", "prompt": "2+2?"}) as s:
            lines = [json.loads(line) for line in s.iter_lines() if line]
        assert "".join(x["response"] for x in lines) == "The answer is 4."
        assert "".join(x.get("thinking", "") for x in lines) == "Two plus two is four."


ANSWER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("model", ["r1", "qwen3-think"])
def test_a_format_holds_the_answer_after_the_thinking(client: ollama.Client, model: str) -> None:
    """As Ollama applies `format` once thinking ends: the reasoning stays the model's own,
    and the content is the JSON (never the thinking, never cut short)."""
    thought = "Two plus two is four." if model == "r1" else THOUGHT
    question = [{"role": "user", "content": "2+2?"}] if model == "r1" else SKY
    r = client.chat(
        model=model, messages=question, format=ANSWER, options={"num_predict": 96, "temperature": 0}
    )
    assert r.message.thinking == thought
    assert set(json.loads(r.message.content or "")) == {"a"}
    g = client.generate(
        model=model, prompt="2+2?", format=ANSWER, options={"num_predict": 96, "temperature": 0}
    )
    assert g.thinking and set(json.loads(g.response)) == {"a"}
    oai = openai.OpenAI(base_url=str(client._client.base_url) + "/v1", api_key="x")
    o = oai.chat.completions.create(
        model=model, messages=question, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
    )  # fmt: skip
    message = o.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == thought
    assert set(json.loads(message.content or "")) == {"a"}


def test_think_on_a_model_that_cannot_is_a_400(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        body = {"model": "qwen25-tools", "messages": SKY, "think": True}
        r = http.post("/api/chat", json=body)
        assert r.status_code == 400 and "does not support thinking" in r.json()["error"]
        r = http.post("/api/chat", json={**body, "think": "sideways"})
        assert r.status_code == 400 and r.json()["error"] == "invalid think value"
        r = http.post("/api/chat", json={**body, "think": False, "stream": False})
        assert r.status_code == 200


def test_openai_reasoning_content(server: RunningServer) -> None:
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120)
    r = oai.chat.completions.create(model="qwen3-think", messages=SKY)
    message = r.choices[0].message
    assert message.content == BLUE
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"] == THOUGHT
    chunks = list(oai.chat.completions.create(model="qwen3-think", messages=SKY, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == THOUGHT
    assert "".join(d.content or "" for d in deltas) == BLUE
    off = oai.chat.completions.create(
        model="qwen3-think",
        messages=SKY,
        reasoning_effort="none",
    )
    assert off.choices[0].message.model_extra is not None
    assert "reasoning_content" not in off.choices[0].message.model_extra


def test_mlxd_run_think_shows_the_thinking_apart(server: RunningServer) -> None:
    result = mlxd(["run", "r1", "2+2?", "--think"], server.port)
    assert result.returncode == 0, err(result)
    assert out(result) == (
        "Thinking...\nTwo plus two is four.\n...done thinking.\n\nThe answer is 4.\n"
    )


def test_a_stream_reports_the_logprobs_of_tokens_the_parser_swallows(
    server: RunningServer,
) -> None:
    """The reply ends on `</think>`, which the splitter takes without a part: its
    log-probability still goes out, so the streamed ones add up to the whole's."""
    body = {"model": "r1", "messages": [{"role": "user", "content": "2+2?"}], "logprobs": True,
            "options": {"num_predict": 3}}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        whole = http.post("/api/chat", json={**body, "stream": False}).json()
        with http.stream("POST", "/api/chat", json=body) as s:
            lines = [json.loads(line) for line in s.iter_lines() if line]
    assert len(whole["logprobs"]) == whole["eval_count"] == 3
    assert [lp for x in lines for lp in x.get("logprobs") or []] == whole["logprobs"]
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120)
    chunks = oai.chat.completions.create(
        model="r1", messages=body["messages"], logprobs=True, max_tokens=3, stream=True
    )
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content or []]  # fmt: skip
    assert [c.token for c in streamed] == [lp["token"] for lp in whole["logprobs"]]


def test_context_after_a_stop_string_is_the_text_sent(server: RunningServer, scripted: Any) -> None:
    """As Ollama's `context` (the prompt and the output as sent, tokenized): a client that
    sends it back continues after what it read, not after the stop it never saw."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(scripted.parent / "r1")
    body = {"model": "r1", "prompt": "2+2?", "stream": False, "options": {"num_predict": 3}}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        stopped = http.post("/api/generate", json={**body, "options": {"stop": [" four"]}}).json()
        whole = http.post("/api/generate", json=body).json()
    n = stopped["prompt_eval_count"]
    assert stopped["done_reason"] == "stop" and stopped["thinking"] == "Two plus two is"
    assert tokenizer.decode(stopped["context"][n:]) == "Two plus two is"
    assert whole["context"][:n] == stopped["context"][:n]
    assert len(whole["context"]) == n + whole["eval_count"]  # no stop: the tokens themselves
