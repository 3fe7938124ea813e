"""/v1 driven by the official `openai` Python client against the real server."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import RunningServer

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "Why is the sky blue?"}
]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="ollama", max_retries=0)


def test_chat_non_stream(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    assert out.model == "tiny"
    assert out.system_fingerprint == "fp_ollama"
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.system_fingerprint == "fp_ollama" for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert last.choices[0].delta.content is None
    assert last.usage is None  # no usage chunk unless asked for
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


def test_usage_reports_the_prompt_tokens_the_cache_restored(client: openai.OpenAI) -> None:
    """`usage.prompt_tokens_details.cached_tokens`, as OpenAI's prompt caching reports it."""
    long = [{"role": "user", "content": "Tell me about caching. " * 40}]
    asked = {"model": "tiny", "messages": long, "max_tokens": 2, "temperature": 0}
    first = client.chat.completions.create(**asked)  # type: ignore[call-overload]
    again = client.chat.completions.create(**asked)  # type: ignore[call-overload]
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and 0 < (details.cached_tokens or 0) < again.usage.prompt_tokens


def test_chat_stream_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, finish, usage = chunks
    assert finish.choices[0].finish_reason == "length"
    assert usage.choices == []
    assert usage.usage is not None
    assert usage.usage.completion_tokens == 5
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 5
    assert content


def test_chat_stop_string(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0
    )
    text = plain.choices[0].message.content or ""
    # a character that first occurs past the start and is not a replacement character
    k = next(i for i, ch in enumerate(text) if i > 0 and text.index(ch) == i and ch != "\ufffd")
    stopped = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=[text[k]]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:k]
    single = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=text[k]
    )
    assert single.choices[0].message.content == text[:k]


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.7, seed=seed
        )
        return out.choices[0].message.content or ""

    first = sample(1234)
    assert first
    assert sample(1234) == first


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert whole.object == "text_completion"
    assert whole.id.startswith("cmpl-")
    assert whole.system_fingerprint == "fp_ollama"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, finish, usage = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert finish.choices[0].finish_reason == "length"
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text


def test_completions_with_suffix_fills_the_middle(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="def add(a, b):\n", suffix="\n    return c\n", max_tokens=6
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    ids = {m.id for m in models.data}
    assert {"tiny:latest", "pair:latest", "selfdraft:latest", "sys:latest"} <= ids
    for m in models.data:
        assert m.object == "model"
        assert m.owned_by == "library"
        assert m.created > 1_600_000_000
    one = client.models.retrieve("tiny")
    assert one.id == "tiny"
    assert one.owned_by == "library"
    assert one.created == next(m.created for m in models.data if m.id == "tiny:latest")


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing", messages=MESSAGES, max_tokens=4)
    assert info.value.status_code == 404
    assert info.value.type == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("missing")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=4)


def test_bad_requests_are_invalid_request_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[])
    assert info.value.body == {
        "message": "[] is too short - 'messages'",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    with pytest.raises(openai.BadRequestError, match="Invalid type"):
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
        )
