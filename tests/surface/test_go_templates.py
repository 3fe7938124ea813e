"""Ollama's Go templates as a model's own template (a Modelfile's TEMPLATE, `/api/create`'s
`template`): rendered turn by turn as Ollama renders its legacy templates, the answer's turn
left open where `{{ .Response }}` stands; templates past that subset refused at create."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.prompt import PromptError, check_go_template, render_generate, render_go_chat
from mlxd.registry.schema import load_registry_file
from tests.conftest import ServerThread
from tests.fixtures.tiny_models import TinyPair

CHATML = (
    "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n"
)


def test_a_conversation_renders_a_pass_per_turn_the_last_one_open() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
        {"role": "user", "content": "please"},  # joined to the one before, as Ollama does
    ]
    assert render_go_chat(CHATML, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nmore\n\nplease<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_without_response_gets_it_at_the_end() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_go_chat("Q: {{ .Prompt }}\nA: ", messages) == "Q: a\nA: bQ: c\nA: "


def test_generate_ends_where_the_response_goes() -> None:
    text = render_generate(None, "hi", "S", CHATML, None, None)
    assert text.endswith("<|im_start|>assistant\n")  # not with the turn's <|im_end|>
    assert render_generate(None, "hi", None, None, None, None, model_template=CHATML) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ range .Messages }}{{ .Content }}{{ end }}",
        "{{ if .Tools }}tools{{ end }}{{ .Prompt }}",
        "{{ .Prompt | trim }}",
        "{{ if .Prompt }}{{ .Prompt }}",
        "{{ .System }} {{ .Prompt",  # unclosed, as Go's parser refuses it
    ],
)
def test_templates_past_the_subset_are_refused(template: str) -> None:
    with pytest.raises(PromptError, match="template"):
        check_go_template(template)


@pytest.fixture
def served(tiny_pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    home = tmp_path / "home"
    monkeypatch.setenv("MLXD_HOME", str(home))
    base = tmp_path / "base.yaml"
    base.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    monkeypatch.setenv("MLXD_REGISTRY", f"{base}{os.pathsep}{home / 'models.yaml'}")
    with ServerThread(None) as info:  # type: ignore[arg-type]
        yield info.base_url


def prompt_text(base_url: str, tiny_pair: TinyPair, path: str, body: dict[str, object]) -> str:
    body = {"model": "legacy", "stream": False, "options": {"num_predict": 1}, **body}
    r = httpx.post(base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["done_reason"] in ("stop", "length")
    ids = done.get("context")
    return (
        ""
        if ids is None
        else load_tokenizer(tiny_pair.target).decode(ids[: done["prompt_eval_count"]])
    )


def test_a_created_model_with_a_go_template_answers(served: str, tiny_pair: TinyPair) -> None:
    client = ollama.Client(host=served, timeout=120)
    client.create(model="legacy", from_="tiny", template=CHATML, system="Be brief.")
    assert client.show("legacy").template == CHATML
    text = prompt_text(served, tiny_pair, "/api/generate", {"prompt": "hi"})
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    reply = client.chat(
        model="legacy",
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                  {"role": "user", "content": "again"}],
        options={"num_predict": 4},
    )  # fmt: skip
    assert reply.done and reply.prompt_eval_count
    with pytest.raises(ollama.ResponseError, match="does not support tools"):
        client.chat(
            model="legacy", messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )  # fmt: skip


def test_a_go_template_past_the_subset_is_refused_at_create(served: str) -> None:
    r = httpx.post(
        served + "/api/create",
        json={"model": "modern", "from": "tiny", "stream": False,
              "template": "{{ range .Messages }}{{ .Content }}{{ end }}"},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 400 and ".Messages" in r.json()["error"]
    home = Path(os.environ["MLXD_HOME"])
    registry = home / "models.yaml"
    assert not registry.exists() or "modern:latest" not in load_registry_file(registry)


def test_a_jinja_template_that_does_not_parse_is_refused_at_create(served: str) -> None:
    """Its line named; a chat template using transformers' `{% generation %}` tag parses."""
    bad = "{% for m in messages %}\n{{ m.content }}\n"
    r = httpx.post(
        served + "/api/create",
        json={"model": "broken", "from": "tiny", "stream": False, "template": bad},
        timeout=60,
    )
    assert r.status_code == 400 and "Jinja syntax error on line 2" in r.json()["error"]
    registry = Path(os.environ["MLXD_HOME"]) / "models.yaml"
    assert not registry.exists() or "broken:latest" not in load_registry_file(registry)
    for unknown in ("{{ messages | nosuchfilter }}", "{% set x = 1 %}{% break %}"):
        r = httpx.post(
            served + "/api/create",
            json={"model": "broken", "from": "tiny", "stream": False, "template": unknown},
            timeout=60,
        )  # found only when the template compiles, not when it parses
        assert r.status_code == 400 and "Jinja syntax error" in r.json()["error"], r.text
    tagged = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    r = httpx.post(
        served + "/api/create",
        json={"model": "tagged", "from": "tiny", "stream": False, "template": tagged},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_debug_render_only_answers_the_prompt_without_running(served: str) -> None:
    client = ollama.Client(host=served, timeout=120)
    client.create(model="legacy", from_="tiny", template=CHATML)
    r = httpx.post(
        served + "/api/generate",
        json={"model": "legacy", "prompt": "hi", "_debug_render_only": True},
        timeout=60,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["_debug_info"] == {
        "rendered_template": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "image_count": 0,
    }
    assert body["done"] is False and "eval_count" not in body
    chat = httpx.post(
        served + "/api/chat",
        json={"model": "legacy", "messages": [{"role": "user", "content": "hi"}],
              "_debug_render_only": True},
        timeout=60,
    ).json()  # fmt: skip
    assert chat["_debug_info"]["rendered_template"] == body["_debug_info"]["rendered_template"]
