"""How a rendered prompt becomes tokens and which template renders it, as Ollama's runner does:
text mlxd renders itself (a FIM prompt, a Go template's, a model with no chat template) gets the
tokenizer's BOS as a raw prompt does, a chat template's text keeps its own (never two); a
model's Go template naming `{{ .Suffix }}` renders fill-in-the-middle; and the model's own
thinking tags split a reply whose prompt a request's template or `raw` made, where `think`
asks for it; a chat ending with an assistant's message is continued (a prefill)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerThread
from tests.fixtures.scripted_models import Script, build_scripted

BOS = "<|begin_of_text|>"
FIM = ("<PRE>", "<SUF>", "<MID>")
INFILL = "<P>{{ .Prompt }}<S>{{ .Suffix }}<M>"
SPM = "<|fim_prefix|><|fim_suffix|>{{ .Suffix }}<|fim_middle|>{{ .Prompt }}"
QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
THOUGHT, ANSWER = "\nThe user asks.\n", "\n\nIt is blue."
SHORT = {"num_predict": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("prompt-tokens")
    code = Script("<MID>", ("return", " a + b"))
    models = {
        "fim-bos": build_scripted(root / "fim", "llama3", code, adds_bos=True, specials=FIM),
        "base-bos": build_scripted(
            root / "base", "llama3", code, adds_bos=True, chat_template=False, specials=FIM
        ),
        "plain": build_scripted(root / "plain", "qwen2_5", Script("\n", ("Hello",))),
        "qwen-fim": build_scripted(
            root / "qfim", "qwen2_5", Script("<|fim_middle|>", ("return",)), specials=QWEN_FIM
        ),
        "thinker": build_scripted(
            root / "think", "qwen3", Script("\n", ("<think>", THOUGHT, "</think>", ANSWER))
        ),
        "prefill": build_scripted(
            root / "prefill", "qwen2_5", Script("\n", ("I would", " rather", " chat."))
        ),
    }
    lines = ["models:"]
    for name, path in models.items():
        lines.append(f"  {name}:\n    target: {path}\n    options:\n      temperature: 0")
    lines.append(f"  infill:\n    target: {models['plain']}\n    template: '{INFILL}'")
    lines.append(f"  spm:\n    target: {models['qwen-fim']}\n    template: '{SPM}'")
    registry = root / "models.yaml"
    registry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with ServerThread(registry) as info, httpx.Client(base_url=info.base_url, timeout=120) as c:
        yield c


def generate(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/api/generate", json={"stream": False, "options": SHORT, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_fill_in_the_middle_prompt_opens_with_bos(served: httpx.Client) -> None:
    raw = generate(served, model="fim-bos", prompt="<PRE>def f():<SUF>\n<MID>", raw=True)
    fim = generate(served, model="fim-bos", prompt="def f():", suffix="\n")
    assert fim["prompt_eval_count"] == raw["prompt_eval_count"]
    assert fim["response"] == raw["response"] == "return a + b"
    r = served.post(
        "/v1/completions", json={"model": "fim-bos", "prompt": "def f():", "suffix": "\n"}
    )
    assert r.json()["usage"]["prompt_tokens"] == raw["prompt_eval_count"]


def test_a_model_without_a_chat_template_tokenizes_as_raw(served: httpx.Client) -> None:
    raw = generate(served, model="base-bos", prompt="x", raw=True)
    rendered = generate(served, model="base-bos", prompt="x")
    assert rendered["prompt_eval_count"] == raw["prompt_eval_count"] == 2  # BOS and "x"


def test_bos_is_never_doubled(served: httpx.Client) -> None:
    """A chat template writes its BOS; so may a raw prompt: neither gets a second."""
    chat = generate(served, model="fim-bos", prompt="hi")
    raw = generate(served, model="base-bos", prompt=BOS + "x", raw=True)
    assert raw["prompt_eval_count"] == 2
    first = chat["context"][0]
    assert chat["context"].count(first) == 1


def test_a_model_template_naming_the_suffix_takes_one(served: httpx.Client) -> None:
    caps = served.post("/api/show", json={"model": "infill"}).json()["capabilities"]
    assert "insert" in caps
    assert "insert" not in served.post("/api/show", json={"model": "plain"}).json()["capabilities"]
    r = served.post(
        "/api/generate",
        json={"model": "infill", "prompt": "AAA", "suffix": "BBB", "_debug_render_only": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["_debug_info"]["rendered_template"] == "<P>AAA<S>BBB<M>"
    # without a suffix the same template renders the prompt alone
    r = served.post(
        "/api/generate", json={"model": "infill", "prompt": "AAA", "_debug_render_only": True}
    )
    assert r.json()["_debug_info"]["rendered_template"] == "<P>AAA<S><M>"
    for raw in (False, True):  # raw too (an editor's completion request), as Ollama checks
        refused = served.post(
            "/api/generate", json={"model": "plain", "prompt": "a", "suffix": "b", "raw": raw}
        )
        assert refused.status_code == 400
        assert "does not support insert" in refused.json()["error"]


def test_the_model_template_comes_before_its_fim_tokens(served: httpx.Client) -> None:
    r = served.post(
        "/api/generate",
        json={"model": "spm", "prompt": "AAA", "suffix": "BBB", "_debug_render_only": True},
    )
    want = "<|fim_prefix|><|fim_suffix|>BBB<|fim_middle|>AAA"
    assert r.json()["_debug_info"]["rendered_template"] == want


@pytest.mark.parametrize("how", ["template", "raw"])
def test_thinking_splits_whatever_rendered_the_prompt(served: httpx.Client, how: str) -> None:
    base = generate(served, model="thinker", prompt="sky?", think=True)
    assert base["thinking"] == THOUGHT.strip() and base["response"] == ANSWER.strip()
    if how == "template":
        template = served.post("/api/show", json={"model": "thinker"}).json()["template"]
        asked = {"prompt": "sky?", "template": template}
    else:
        asked = {"prompt": "<|im_start|>user\nsky?<|im_end|>\n<|im_start|>assistant\n", "raw": True}
    split = generate(served, model="thinker", think=True, **asked)
    assert (split["thinking"], split["response"]) == (base["thinking"], base["response"])
    whole = generate(served, model="thinker", **asked)  # `think` not asked: left as written
    assert "<think>" in whole["response"] and not whole.get("thinking")


def test_a_final_assistant_message_is_continued(served: httpx.Client) -> None:
    """As Ollama's templates leave the last assistant turn open: the model carries on from the
    prefilled text rather than answering anew (the text came back twice before)."""
    hi = {"role": "user", "content": "hi"}
    body = {"model": "prefill", "stream": False, "options": SHORT}
    for prefill, text in (("I would", " rather chat."), ("", "I would rather chat.")):
        messages = [hi, {"role": "assistant", "content": prefill}]
        shown = served.post(
            "/api/chat", json={**body, "messages": messages, "_debug_render_only": True}
        )
        rendered = shown.json()["_debug_info"]["rendered_template"]
        assert rendered.endswith("<|im_start|>assistant\n" + prefill)
        r = served.post("/api/chat", json={**body, "messages": messages})
        assert r.status_code == 200 and r.json()["message"]["content"] == text
    v1 = served.post(
        "/v1/chat/completions",
        json={
            "model": "prefill",
            "max_tokens": 8,
            "messages": [hi, {"role": "assistant", "content": "I would"}],
        },
    )
    assert v1.json()["choices"][0]["message"]["content"] == " rather chat."
