"""A prompt longer than its row's context is cut as Ollama cuts it (the head and the most recent
tokens kept, a warning logged) instead of refused or answered empty."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.api.inference import tokenize
from mlxd.engine.backend import Backend
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import load_pairing
from mlxd.engine.truncation import Budget, fit
from mlxd.registry.schema import ModelEntry
from tests.conftest import RunningServer, ServerThread
from tests.fixtures.scripted_models import Script, build_scripted
from tests.fixtures.tiny_models import SPECIAL_TOKENS, TinyPair

CTX = 96
SYSTEM = "You are a terse assistant who answers in one word."
LLAMA_BOS = "<|begin_of_text|>"


def test_budget_leaves_room_to_answer() -> None:
    assert Budget.of(100, -1).prompt == 75  # a quarter when num_predict is unbounded
    assert Budget.of(100, 10).prompt == 90
    assert Budget.of(100, 500).prompt == 50  # never more than half
    assert Budget.of(2, 0).prompt == 1


def test_fit_keeps_the_head_and_the_end() -> None:
    assert fit([1, 2], [3, 4, 5], 5) == [1, 2, 3, 4, 5]
    assert fit([1, 2], list(range(10, 20)), 6) == [1, 2, 16, 17, 18, 19]
    assert fit(list(range(10)), [50, 51], 6) == [0, 1, 2, 3, 50, 51]
    assert fit(list(range(10)), [50, 51, 52, 53, 54], 6) == [0, 1, 2, 52, 53, 54]


@pytest.fixture(scope="module")
def short(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    registry: Path = tmp_path_factory.mktemp("trunc") / "models.yaml"
    registry.write_text(
        f"models:\n  short:\n    target: {tiny_pair.target}\n"
        f"    options:\n      num_ctx: {CTX}\n      temperature: 0\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info


def story(n: int) -> str:
    return " ".join(f"line {i} of a long story." for i in range(n)) + " The end is here."


def no_special_text(text: str) -> None:
    for token in SPECIAL_TOKENS:
        assert token not in text


def test_generate_keeps_the_system_prompt_and_the_latest_tokens(
    short: RunningServer, tiny_pair: TinyPair, caplog: pytest.LogCaptureFixture
) -> None:
    client = ollama.Client(host=short.base_url)
    with caplog.at_level(logging.WARNING, logger="mlxd.api.inference"):
        out = client.generate(
            "short", story(80), system=SYSTEM, options={"num_predict": 6}, stream=False
        )
    assert any("truncating input prompt" in r.getMessage() for r in caplog.records)
    assert out.prompt_eval_count == CTX - 6
    assert out.eval_count == 6 or out.done_reason == "stop"
    no_special_text(out.response)
    tokenizer = load_tokenizer(tiny_pair.target)
    prompt = out.context[: out.prompt_eval_count]
    kept = tokenizer.decode(prompt)
    assert kept.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert kept.endswith("The end is here.<|im_end|>\n<|im_start|>assistant\n")
    assert "line 0 of" not in kept


def test_chat_keeps_the_system_message_and_the_last_turn(short: RunningServer) -> None:
    client = ollama.Client(host=short.base_url)
    history = [{"role": "system", "content": SYSTEM}]
    for i in range(12):
        history += [
            {"role": "user", "content": story(3)},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    history.append({"role": "user", "content": "last question?"})
    out = client.chat("short", history, options={"num_predict": 4}, stream=False)
    assert out.prompt_eval_count == CTX - 4
    no_special_text(out.message.content)


def test_num_ctx_narrower_than_the_prompt_is_honoured(short: RunningServer) -> None:
    r = httpx.post(
        short.base_url + "/api/generate",
        json={"model": "short", "prompt": story(20), "stream": False,
              "options": {"num_ctx": 40, "num_predict": 8}},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] == 32


def test_v1_routes_cut_too(short: RunningServer) -> None:
    client = openai.OpenAI(base_url=short.base_url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="short", messages=[{"role": "user", "content": story(60)}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == CTX - 3
    text = client.completions.create(model="short", prompt=story(60), max_tokens=3)
    assert text.usage is not None and text.usage.prompt_tokens == CTX - 3


def test_a_long_context_array_drops_its_oldest_tokens_first(
    short: RunningServer, tiny_pair: TinyPair
) -> None:
    """`context` is the conversation so far: cut from its start, the new turn kept whole."""
    tokenizer = load_tokenizer(tiny_pair.target)
    old = tokenizer.encode(story(80), add_special_tokens=False)
    assert len(old) > 2 * CTX
    body = {"model": "short", "prompt": "and then?", "context": old, "stream": False,
            "options": {"num_predict": 4}}  # fmt: skip
    out = httpx.post(short.base_url + "/api/generate", json=body, timeout=120).json()
    kept = out["context"][: out["prompt_eval_count"]]
    assert out["prompt_eval_count"] == CTX - 4
    text = tokenizer.decode(kept)
    assert text.endswith("and then?<|im_end|>\n<|im_start|>assistant\n")  # the new turn whole
    assert tokenizer.decode(old[-8:]) in text  # the most recent of the old, not the oldest
    assert tokenizer.decode(old[:8]) not in text


def test_truncate_false_refuses_a_prompt_that_does_not_fit(short: RunningServer) -> None:
    for route, extra in (
        ("/api/generate", {"prompt": story(80)}),
        ("/api/chat", {"messages": [{"role": "user", "content": story(80)}]}),
    ):
        body = {"model": "short", "truncate": False, "stream": False, **extra}
        r = httpx.post(short.base_url + route, json=body, timeout=120)
        assert r.status_code == 400, route
        assert r.json() == {"error": "the input length exceeds the context length"}
        fits = {**body, **({"prompt": "hi"} if "prompt" in extra else
                           {"messages": [{"role": "user", "content": "hi"}]})}  # fmt: skip
        assert httpx.post(short.base_url + route, json=fits, timeout=120).status_code == 200
    # within the context but past the room the cut would keep for the answer: sent whole
    r = httpx.post(short.base_url + "/api/generate", timeout=120, json={
        "model": "short", "prompt": story(4), "truncate": False, "stream": False,
        "options": {"num_predict": 60}})  # fmt: skip
    assert r.status_code == 200 and CTX - 60 < r.json()["prompt_eval_count"] < CTX, r.text


def test_a_vocabulary_of_long_tokens_widens_the_window_read() -> None:
    assert Budget.of(100, 10, chars_per_token=65).window > 100 * 64


@pytest.fixture(scope="module")
def opening(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Path]]:
    """A Llama 3 template (its rendering opens with BOS and a system block whatever the
    messages) on a model that answers "Marked answer!" where BOS is in what it reads."""
    root = tmp_path_factory.mktemp("opening")
    script = Script("\n", ("Plain", " answer", "."), ("Marked", " answer", "!"), LLAMA_BOS)
    model = build_scripted(root / "l3", "llama3", script)
    registry = root / "models.yaml"
    registry.write_text(
        f"models:\n  l3:\n    target: {model}\n    options:\n      temperature: 0\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info, model


def test_a_cut_chat_without_a_system_message_keeps_the_templates_opening(
    opening: tuple[RunningServer, Path],
) -> None:
    """The head kept is what the template writes before the first message (BOS, its default
    system block), as Ollama renders the template again over the messages it keeps."""
    history = []
    for i in range(30):
        history += [
            {"role": "user", "content": f"question number {i}"},
            {"role": "assistant", "content": f"answer number {i}"},
        ]
    history.append({"role": "user", "content": "last one"})
    body = {"model": "l3", "messages": history, "stream": False,
            "options": {"num_ctx": 256, "num_predict": 3}}  # fmt: skip
    out = httpx.post(opening[0].base_url + "/api/chat", json=body, timeout=120).json()
    assert out["prompt_eval_count"] < 256
    assert out["message"]["content"] == "Marked answer!"


def test_a_cut_context_keeps_its_bos(opening: tuple[RunningServer, Path]) -> None:
    """The text after a `context` leaves its own BOS out, so where the context is cut its
    BOS stays first: the prompt opens with one BOS, as it does uncut."""
    url = opening[0].base_url + "/api/generate"
    first = httpx.post(url, timeout=120, json={
        "model": "l3", "prompt": story(12), "stream": False, "options": {"num_predict": 3}
    }).json()  # fmt: skip
    bos = first["context"][0]
    for num_ctx in (10_000, len(first["context"]) + 40, 60):
        out = httpx.post(url, timeout=120, json={
            "model": "l3", "prompt": "and then?", "context": first["context"], "stream": False,
            "options": {"num_ctx": num_ctx, "num_predict": 3},
        }).json()  # fmt: skip
        kept = out["context"][: out["prompt_eval_count"]]
        assert kept[0] == bos and kept.count(bos) == 1, num_ctx
        assert out["response"] == "Marked answer!"


def test_a_rendering_asked_with_a_context_shows_it_first(
    opening: tuple[RunningServer, Path],
) -> None:
    """`_debug_render_only` answers the prompt as the model reads it: the context's text,
    then the rendering (as Ollama writes them into one buffer)."""
    url = opening[0].base_url + "/api/generate"
    first = httpx.post(url, timeout=120, json={
        "model": "l3", "prompt": "hi", "stream": False, "options": {"num_predict": 3}
    }).json()  # fmt: skip
    asked = {"model": "l3", "prompt": "and then?", "_debug_render_only": True}
    alone = httpx.post(url, json=asked, timeout=120).json()["_debug_info"]["rendered_template"]
    shown = httpx.post(url, json={**asked, "context": first["context"]}, timeout=120).json()
    text = load_tokenizer(opening[1]).decode(first["context"])
    assert shown["_debug_info"]["rendered_template"] == text + alone


def test_a_head_cut_inside_a_special_token_keeps_none_of_it(
    tiny_pair: TinyPair, backend: Backend
) -> None:
    """Two renderings can share the first characters of different special tokens (a
    template that writes nothing for an empty user message: `<|im_start|>` against
    `<|im_end|>`): the head keeps whole tokens of the text only, not `<|im_` as text."""
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend)
    opts = parse_options({"num_ctx": CTX, "num_predict": 8})
    text = "<|im_start|>user\n" + story(40) + "<|im_end|>\n<|im_start|>assistant\n"
    kept = tokenize(pairing, opts, [], text, True, head=lambda: "<|im_end|>\n")
    assert len(kept) == CTX - 8
    assert not pairing.tokenizer.decode(kept).startswith("<|im_")
