"""Real clients' tool flows: ollama, openai, LangChain's ChatOllama and LiteLLM."""

from __future__ import annotations

import json
from typing import Any

import ollama
import openai
import pytest

from tests.conftest import RunningServer
from tests.tools.conftest import ANSWER, CALL_ARGS, CITY, WEATHER

pytestmark = pytest.mark.filterwarnings("ignore:Items? .*ReadOnly:UserWarning")
QUESTION = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """The current weather in a city.

    Args:
        city: The city
    """
    return "18 degrees"


# -- ollama -------------------------------------------------------------------------------------


def test_ollama_tool_flow(server: RunningServer) -> None:
    """call -> tool message -> final answer; the model answers only once the result is in
    its prompt (its script switches on <tool_response>)."""
    client = ollama.Client(host=server.base_url, timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = client.chat(model="qwen3-tools", messages=messages, tools=[get_weather], think=False)
    [call] = first.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert dict(call.function.arguments) == CALL_ARGS
    assert first.message.content == "Let me check. "
    messages.append(first.message)
    result = get_weather(**call.function.arguments)
    messages.append({"role": "tool", "content": result, "tool_name": call.function.name})
    final = client.chat(model="qwen3-tools", messages=messages, tools=[get_weather], think=False)
    assert final.message.content == ANSWER
    assert not final.message.tool_calls


def test_ollama_stream_tool_call(server: RunningServer) -> None:
    client = ollama.Client(host=server.base_url, timeout=120)
    parts = list(
        client.chat(
            model="qwen3-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[WEATHER],
            stream=True,
        )
    )
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", CALL_ARGS)
    ]
    assert "".join(p.message.content or "" for p in parts) == "Let me check. "
    assert parts[-1].done


# -- openai -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120)


def test_openai_tool_flow(oai: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(model="qwen3-tools", messages=messages, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees"})
    final = oai.chat.completions.create(model="qwen3-tools", messages=messages, tools=[WEATHER])
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].finish_reason == "stop"


def test_openai_streamed_deltas(oai: openai.OpenAI) -> None:
    with oai.chat.completions.stream(
        model="qwen3-tools", messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER]
    ) as stream:
        for _ in stream:
            pass
        done = stream.get_final_completion()
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls or []
    assert call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS


def test_openai_raw_stream_chunks(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.chat.completions.create(
            model="qwen3-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[WEATHER],
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].type == "function"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all("<tool_call>" not in (d.content or "") for d in deltas)


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_openai_tool_choice_that_allows_the_call(oai: openai.OpenAI, choice: Any) -> None:
    r = oai.chat.completions.create(
        model="qwen25-tools",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
        tool_choice=choice,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls


def test_openai_tool_choice_none_leaves_tools_out(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="qwen25-tools",
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
        tool_choice="none",
    )
    assert r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    assert r.usage is not None
    plain = oai.chat.completions.create(
        model="qwen25-tools", messages=[{"role": "user", "content": QUESTION}]
    )
    assert plain.usage is not None and r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_openai_tool_choice_naming_an_undeclared_function_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model="qwen25-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize("function", ["x", [1], None])
def test_openai_tool_choice_over_a_malformed_tool_is_a_400(
    oai: openai.OpenAI, function: Any
) -> None:
    """A tool whose `function` is not an object, named by `tool_choice`: the same 400 as
    without the choice, not a crash reading it."""
    with pytest.raises(openai.BadRequestError, match="function with a name"):
        oai.chat.completions.create(
            model="qwen25-tools",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[{"type": "function", "function": function}],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "f"}},
        )


# -- LangChain and LiteLLM ----------------------------------------------------------------------


def test_langchain_bind_tools(server: RunningServer) -> None:
    langchain_ollama = pytest.importorskip("langchain_ollama")
    llm = langchain_ollama.ChatOllama(model="qwen25-tools", base_url=server.base_url)
    message = llm.bind_tools([get_weather]).invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", CALL_ARGS)]


def test_litellm_ollama_chat(server: RunningServer) -> None:
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(
        model="ollama_chat/qwen25-tools",
        api_base=server.base_url,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER],
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS


# -- tool_choice forces a call through the grammar ----------------------------------------------


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_forces_a_call_on_a_model_that_would_not(
    oai: openai.OpenAI, choice: Any, stream: bool
) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    plain = oai.chat.completions.create(model="talker", messages=messages, tools=[CITY])
    assert plain.choices[0].message.content == "I would rather chat."
    if stream:
        with oai.chat.completions.stream(
            model="talker", messages=messages, tools=[CITY], tool_choice=choice
        ) as s:
            for _ in s:
                pass
            r = s.get_final_completion()
    else:
        r = oai.chat.completions.create(
            model="talker", messages=messages, tools=[CITY], tool_choice=choice
        )
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    # the grammar chose for a model with no opinion: any value the schema allows
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    assert not r.choices[0].message.content
