"""/api/ps on a CPU-only host, /api/show's tokenizer keys (verbose or not) and its template,
which /api/generate's `template` takes back."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.backend import configure_backend
from tests.conftest import RunningServer
from tests.fixtures.tiny_models import TinyPair


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def test_ps_size_vram_follows_the_device(http: httpx.Client) -> None:
    r = http.post("/api/generate", json={"model": "tiny", "prompt": ""})
    assert r.status_code == 200, r.text
    (model,) = [m for m in http.get("/api/ps").json()["models"] if m["name"] == "tiny:latest"]
    if configure_backend().device == "cpu":
        assert model["size_vram"] == 0 < model["size"]
    else:
        assert model["size_vram"] == model["size"]


def test_show_has_ollamas_tokenizer_keys(server: RunningServer, tiny_pair: TinyPair) -> None:
    client = ollama.Client(host=server.base_url)
    short = client.show("tiny").modelinfo or {}
    assert short["tokenizer.ggml.model"] == "gpt2"
    assert short["tokenizer.ggml.tokens"] == [] and short["tokenizer.ggml.merges"] == []
    full = httpx.post(
        server.base_url + "/api/show", json={"model": "tiny", "verbose": True}, timeout=60
    ).json()["model_info"]
    tokenizer = load_tokenizer(tiny_pair.target)
    vocab = tokenizer.get_vocab()
    tokens = full["tokenizer.ggml.tokens"]
    assert len(tokens) == len(vocab)
    assert all(tokens[i] == t for t, i in vocab.items())
    assert full["tokenizer.ggml.token_type"][vocab["<|im_start|>"]] == 3  # control
    assert full["tokenizer.ggml.token_type"][vocab["def"]] == 1
    assert full["tokenizer.ggml.merges"] and " " in full["tokenizer.ggml.merges"][0]
    assert full["tokenizer.ggml.eos_token_id"] in tokenizer.eos_token_ids
    assert isinstance(full["tokenizer.ggml.add_bos_token"], bool)


def prompt_of(http: httpx.Client, **body: object) -> list[int]:
    r = http.post(
        "/api/generate",
        json={"model": "tiny", "prompt": "hi there", "stream": False,
              "options": {"num_predict": 1, "temperature": 0}, **body},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    done = r.json()
    return list(done["context"][: done["prompt_eval_count"]])


def test_the_shown_template_is_one_generate_takes(http: httpx.Client, tiny_pair: TinyPair) -> None:
    template = http.post("/api/show", json={"model": "tiny"}).json()["template"]
    assert "{%" in template  # the chat template: Jinja
    plain = prompt_of(http, system="Be brief.")
    assert prompt_of(http, system="Be brief.", template=template) == plain
    edited = template.replace("<|im_start|>", "<|im_start|>>")
    tokenizer = load_tokenizer(tiny_pair.target)
    text = tokenizer.decode(prompt_of(http, system="Be brief.", template=edited))
    assert text.startswith("<|im_start|>>system\nBe brief.<|im_end|>")


def test_go_templates_still_work(http: httpx.Client, tiny_pair: TinyPair) -> None:
    tokens = prompt_of(
        http, system="S", template="{{ if .System }}[{{ .System }}] {{ end }}Q: {{ .Prompt }}"
    )
    assert load_tokenizer(tiny_pair.target).decode(tokens) == "[S] Q: hi there"
