"""The real `ollama` Python client against a real mlxd server (tiny random models)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ollama
import pytest

from tests.conftest import RunningServer

GREEDY: dict[str, Any] = {"temperature": 0, "seed": 7, "num_predict": 12}
METRICS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)
HEX64 = re.compile(r"^[0-9a-f]{64}$")
REGISTERED = ("tiny:latest", "pair:latest", "selfdraft:latest", "sys:latest")


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def check_final(final: Any, num_predict: int | None = None) -> None:
    """Ollama's final object: done, a reason, six non-negative integer metrics."""
    assert final.done is True
    assert final.done_reason in ("stop", "length")
    for key in METRICS:
        value = getattr(final, key)
        assert isinstance(value, int) and not isinstance(value, bool), key
        assert value >= 0, key
    # total runs from request start to the last chunk; it contains every other phase.
    assert final.total_duration >= final.load_duration
    assert final.total_duration >= final.eval_duration
    assert final.total_duration >= final.prompt_eval_duration
    assert final.prompt_eval_count > 0
    if num_predict is not None:
        assert final.done_reason == "length"
        assert final.eval_count == num_predict


def check_stream(chunks: Sequence[Any]) -> Any:
    """Every chunk but the last is not done; the last is; returns the last."""
    assert chunks, "the stream was empty"
    assert all(c.done is False for c in chunks[:-1])
    assert chunks[-1].done is True
    return chunks[-1]


# -- generate --------------------------------------------------------------------------------


def test_generate_non_stream(client: ollama.Client) -> None:
    r = client.generate(model="tiny", prompt="def fib(n):", options=GREEDY)
    assert r.model == "tiny"
    assert isinstance(r.response, str) and r.response
    check_final(r, num_predict=GREEDY["num_predict"])
    # context = prompt tokens + generated tokens, so eval_count counts the generated tokens
    assert r.context is not None
    assert len(r.context) == r.prompt_eval_count + r.eval_count


def test_generate_stream_concatenates_to_non_stream(client: ollama.Client) -> None:
    whole = client.generate(model="tiny", prompt="Once upon a time", options=GREEDY)
    chunks = list(
        client.generate(model="tiny", prompt="Once upon a time", options=GREEDY, stream=True)
    )
    final = check_stream(chunks)
    assert all(isinstance(c.response, str) for c in chunks)
    assert final.response == ""
    assert "".join(c.response for c in chunks) == whole.response
    check_final(final, num_predict=GREEDY["num_predict"])
    assert final.context == whole.context
    assert final.prompt_eval_count == whole.prompt_eval_count
    for c in chunks[:-1]:
        assert c.eval_count is None and c.done_reason is None and c.context is None


def test_generate_num_predict_gives_length(client: ollama.Client) -> None:
    for n in (1, 5):
        r = client.generate(
            model="tiny", prompt="hello", options={"temperature": 0, "num_predict": n}
        )
        assert r.done_reason == "length"
        assert r.eval_count == n


def _stop_candidate(text: str) -> str:
    """A short ASCII-alphanumeric piece of `text` that first occurs after its start."""
    for i in range(1, len(text) // 2):  # early, so the stop lands well before num_predict
        piece = text[i : i + 2]
        if piece.isascii() and piece.isalnum() and text.index(piece) == i:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_the_stream(client: ollama.Client) -> None:
    opts = {"temperature": 0, "num_predict": 24}
    free = client.generate(model="tiny", prompt="The quick brown fox", options=opts)
    assert free.done_reason == "length"
    stop = _stop_candidate(free.response)
    cut = free.response.index(stop)

    chunks = list(
        client.generate(
            model="tiny",
            prompt="The quick brown fox",
            options={**opts, "stop": [stop]},
            stream=True,
        )
    )
    final = check_stream(chunks)
    text = "".join(c.response for c in chunks)
    assert final.done_reason == "stop"
    assert stop not in text
    assert text == free.response[:cut]
    assert final.eval_count < free.eval_count

    # the same through the non-streaming path
    r = client.generate(
        model="tiny", prompt="The quick brown fox", options={**opts, "stop": [stop]}
    )
    assert r.done_reason == "stop"
    assert r.response == free.response[:cut]


def test_empty_prompt_loads_and_keep_alive_zero_unloads(client: ollama.Client) -> None:
    r = client.generate(model="sys")
    assert r.done is True and r.done_reason == "load" and r.response == ""
    r = client.generate(model="sys", prompt="", keep_alive=0)
    assert r.done is True and r.done_reason == "unload"
    # the model comes back on the next request
    r = client.generate(model="sys", prompt="hi")
    assert r.done_reason == "length" and r.eval_count == 8
    r = client.chat(model="sys", messages=[])
    assert r.done_reason == "load" and r.message.role == "assistant" and r.message.content == ""


def test_context_round_trip(client: ollama.Client) -> None:
    first = client.generate(model="tiny", prompt="Hello there", options=GREEDY)
    assert first.context
    second = client.generate(
        model="tiny", prompt="And then?", context=first.context, options=GREEDY
    )
    check_final(second, num_predict=GREEDY["num_predict"])
    alone = client.generate(model="tiny", prompt="And then?", options=GREEDY)
    assert second.prompt_eval_count == len(first.context) + alone.prompt_eval_count
    assert second.prompt_eval_count > first.prompt_eval_count
    assert second.context is not None
    assert list(second.context[: len(first.context)]) == list(first.context)


def test_raw_with_system_is_rejected(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="tiny", prompt="x", raw=True, system="be brief")
    assert info.value.status_code == 400
    assert "raw mode does not support" in info.value.error


def test_raw_has_no_context(client: ollama.Client) -> None:
    r = client.generate(model="tiny", prompt="plain text", raw=True, options=GREEDY)
    check_final(r, num_predict=GREEDY["num_predict"])
    assert r.context is None


def test_suffix_fill_in_the_middle(client: ollama.Client) -> None:
    r = client.generate(
        model="tiny", prompt="def add(a, b):\n    ", suffix="\n    return c\n", options=GREEDY
    )
    check_final(r, num_predict=GREEDY["num_predict"])
    assert isinstance(r.response, str) and r.response
    plain = client.generate(model="tiny", prompt="def add(a, b):\n    ", options=GREEDY)
    assert r.prompt_eval_count != plain.prompt_eval_count  # the suffix reached the prompt


# -- chat ------------------------------------------------------------------------------------


def test_chat_non_stream_and_stream(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    whole = client.chat(model="tiny", messages=messages, options=GREEDY)
    assert whole.message.role == "assistant"
    assert whole.message.content
    check_final(whole, num_predict=GREEDY["num_predict"])

    chunks = list(client.chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    final = check_stream(chunks)
    assert all(c.message.role == "assistant" for c in chunks)
    assert "".join(c.message.content or "" for c in chunks) == whole.message.content
    check_final(final, num_predict=GREEDY["num_predict"])


def test_chat_multi_turn(client: ollama.Client) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ]
    r = client.chat(model="tiny", messages=messages, options=GREEDY)
    check_final(r, num_predict=GREEDY["num_predict"])
    short = client.chat(model="tiny", messages=messages[-1:], options=GREEDY)
    assert r.prompt_eval_count > short.prompt_eval_count


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_generate_is_404(client: ollama.Client, stream: bool) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        result = client.generate(model="nope", prompt="hi", stream=stream)
        if stream:
            list(result)
    assert info.value.status_code == 404
    assert info.value.error == "model 'nope' not found"


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_chat_is_404(client: ollama.Client, stream: bool) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        result = client.chat(
            model="nope", messages=[{"role": "user", "content": "hi"}], stream=stream
        )
        if stream:
            list(result)
    assert info.value.status_code == 404
    assert "nope" in info.value.error and "not found" in info.value.error


def test_unknown_model_show_is_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.show("nope")
    assert info.value.status_code == 404


# -- list and show ---------------------------------------------------------------------------


def test_list(client: ollama.Client) -> None:
    models = client.list().models
    by_name = {m.model: m for m in models}
    for name in REGISTERED:
        assert name in by_name, sorted(by_name)
        m = by_name[name]
        assert m.digest and HEX64.match(m.digest)
        assert m.size and int(m.size) > 0
        assert m.modified_at is not None
        assert m.details is not None
        assert m.details.format == "safetensors"
        assert m.details.family == "llama"
        assert m.details.parameter_size and m.details.quantization_level
    # a pairing is a different model from its target alone
    assert by_name["pair:latest"].digest != by_name["tiny:latest"].digest
    assert int(by_name["pair:latest"].size) > int(by_name["tiny:latest"].size)
    stamps = [m.modified_at for m in models]
    assert stamps == sorted(stamps, reverse=True)


def test_show(client: ollama.Client) -> None:
    r = client.show("tiny")
    assert r.modelinfo is not None
    arch = r.modelinfo["general.architecture"]
    assert arch == "llama"
    ctx = r.modelinfo[f"{arch}.context_length"]
    assert isinstance(ctx, int) and ctx > 0
    assert r.capabilities is not None
    assert "completion" in r.capabilities and "insert" in r.capabilities
    assert r.template and "<|im_start|>" in r.template
    assert r.modelfile and "FROM " in r.modelfile
    assert r.details is not None and r.details.format == "safetensors"
    assert r.modified_at is not None


def test_show_registry_parameters(client: ollama.Client) -> None:
    r = client.show("sys")
    assert r.parameters is not None
    assert "num_predict" in r.parameters and "temperature" in r.parameters
    assert "You are terse." in (r.modelfile or "")


# -- the registry entry's system prompt and options ------------------------------------------


def test_model_system_prompt_is_applied_in_chat(client: ollama.Client) -> None:
    via_entry = client.chat(model="sys", messages=[{"role": "user", "content": "hello"}])
    explicit = client.chat(
        model="tiny",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hello"},
        ],
        options={"temperature": 0, "num_predict": 8},
    )
    without = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        options={"temperature": 0, "num_predict": 8},
    )
    assert via_entry.message.content == explicit.message.content
    assert via_entry.prompt_eval_count == explicit.prompt_eval_count
    assert without.prompt_eval_count < via_entry.prompt_eval_count


def test_request_system_message_replaces_model_system(client: ollama.Client) -> None:
    mine = [{"role": "system", "content": "Be verbose."}, {"role": "user", "content": "hello"}]
    via_entry = client.chat(model="sys", messages=mine)
    explicit = client.chat(
        model="tiny", messages=mine, options={"temperature": 0, "num_predict": 8}
    )
    assert via_entry.message.content == explicit.message.content
    assert via_entry.prompt_eval_count == explicit.prompt_eval_count


def test_model_system_prompt_is_applied_in_generate(client: ollama.Client) -> None:
    via_entry = client.generate(model="sys", prompt="hello")
    explicit = client.generate(
        model="tiny",
        prompt="hello",
        system="You are terse.",
        options={"temperature": 0, "num_predict": 8},
    )
    assert via_entry.response == explicit.response
    assert via_entry.prompt_eval_count == explicit.prompt_eval_count
    other = client.generate(model="sys", prompt="hello", system="Be verbose.")
    mine = client.generate(
        model="tiny",
        prompt="hello",
        system="Be verbose.",
        options={"temperature": 0, "num_predict": 8},
    )
    assert other.response == mine.response


def test_registry_options_apply_when_request_has_none(client: ollama.Client) -> None:
    a = client.generate(model="sys", prompt="Tell me a story")
    b = client.generate(model="sys", prompt="Tell me a story")
    assert a.done_reason == "length" and a.eval_count == 8  # num_predict 8 from the registry
    assert a.response == b.response  # temperature 0 from the registry: greedy, repeatable
    c = client.chat(model="sys", messages=[{"role": "user", "content": "Tell me a story"}])
    assert c.done_reason == "length" and c.eval_count == 8


def test_request_options_override_registry_options(client: ollama.Client) -> None:
    r = client.generate(model="sys", prompt="Tell me a story", options={"num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    base = client.generate(model="sys", prompt="Tell me a story")
    # temperature 0 still comes from the registry: the 3 tokens are the first 3 of the 8
    assert base.context is not None and r.context is not None
    assert list(r.context) == list(base.context[: len(r.context)])
    longer = client.generate(model="sys", prompt="Tell me a story", options={"num_predict": 11})
    assert longer.eval_count == 11


def test_empty_system_falls_back_to_model_system(client: ollama.Client) -> None:
    via_entry = client.generate(model="sys", prompt="hello")
    empty = client.generate(model="sys", prompt="hello", system="")
    assert empty.prompt_eval_count == via_entry.prompt_eval_count
    assert empty.response == via_entry.response
