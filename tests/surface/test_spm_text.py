"""Text on SentencePiece (Llama-2-like) vocabularies, through the real server: a `▁word`
token's text keeps its space and its bytes are its own, also where only `tokenizer.model`
ships; `text_offset` indexes the reply's text, which drops its first space; `context` after a
stop string and sent back reads as prompt and reply, one BOS in all; CodeLlama's `▁<PRE>`
pieces fill in the middle and `▁<EOT>` ends the fill."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conftest import ServerThread
from tests.fixtures.scripted_models import Script
from tests.fixtures.spm_models import BOS, build_spm, build_spm_model_only, piece_bytes

EMOJI = ("<0xF0>", "<0x9F>", "<0x98>", "<0x80>")  # 😀 in byte pieces
HELLO = Script("]", ("▁Hello", "▁world", "!", "▁", *EMOJI))  # after Llama 2's "[/INST]"
SPLIT = Script("]", ("▁Hello", "▁w", "orld", "!", "▁", *EMOJI))
TEXT = "Hello world! 😀"  # what both write: SentencePiece drops the first space
OPENS_BARE = Script(":", ("Hello", "▁there", "!", "▁bye"))  # no `▁`: the reply opens unspaced
FILL = Script("▁<MID>", ("▁return", "▁n", "▁<EOT>", "▁after"))
CHAT_PROMPT = "<s>[INST] hi [/INST]"
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spm")
    return {
        "llama2": build_spm(root / "llama2", HELLO),
        "plain": build_spm(root / "plain", OPENS_BARE, chat_template=False),
        "codellama": build_spm(root / "codellama", FILL, chat_template=False, fim=True),
        # written with (and converted on load by) sentencepiece, which mlx-lm installs
        "model-only": build_spm_model_only(root / "model-only", SPLIT),
    }


@pytest.fixture(scope="module")
def served(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    lines = ["models:"]
    lines += [f"  {name}:\n    target: {path}" for name, path in models.items()]
    registry = tmp_path_factory.mktemp("spm-registry") / "models.yaml"
    registry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with ServerThread(registry) as info, httpx.Client(base_url=info.base_url, timeout=120) as c:
        yield c


def tokenizer(models: dict[str, Path], name: str) -> Tokenizer:
    return Tokenizer.from_file(str(models[name] / "tokenizer.json"))


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = client.post(path, json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def generate(client: httpx.Client, **body: Any) -> dict[str, Any]:
    options = {**GREEDY, **body.pop("options", {})}
    return post(client, "/api/generate", options=options, **body)


def events(client: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    """A streamed response's JSON objects, NDJSON or server-sent events alike."""
    out = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            data = line.removeprefix("data: ").strip()
            if data and data != "[DONE]":
                out.append(json.loads(data))
    return out


def test_logprob_tokens_keep_their_space_and_bytes_join_into_the_text(
    served: httpx.Client,
) -> None:
    """`▁world` reads " world" (decoded alone, the tokenizer drops its space), as byte-level
    models' tokens read and as its bytes say; the bytes join into the reply's text."""
    done = generate(served, model="llama2", prompt="hi", logprobs=True)
    assert done["response"] == TEXT
    tokens = [lp["token"] for lp in done["logprobs"]]
    assert tokens[:4] == [" Hello", " world", "!", " "]
    joined = b"".join(bytes(lp["bytes"]) for lp in done["logprobs"])
    assert joined == b"".join(piece_bytes(p) for p in HELLO.first)
    assert joined.decode() == " " + TEXT
    chat = post(
        served,
        "/v1/chat/completions",
        model="llama2",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        temperature=0,
        max_tokens=16,
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content][:4] == tokens[:4]


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_indexes_the_returned_text(served: httpx.Client, stream: bool) -> None:
    """The reply drops `▁Hello`'s space, so offsets count from "Hello": " world" at 5, "!" at
    11; the emoji's four byte tokens share the one character's offset."""
    body = {"model": "llama2", "prompt": CHAT_PROMPT, "logprobs": 1, "temperature": 0}
    if stream:
        choices = [e["choices"][0] for e in events(served, "/v1/completions", **body)]
        choices = [c for c in choices if c.get("text") or c.get("logprobs")]
        text = "".join(c["text"] for c in choices)
        offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    else:
        choice = post(served, "/v1/completions", **body)["choices"][0]
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == TEXT
    assert offsets == [0, 5, 11, 12, 13, 13, 13, 13]
    assert text[offsets[2]] == "!" and text[offsets[4]] == "😀"


def test_context_after_a_stop_string_decodes_to_prompt_and_reply(
    served: httpx.Client, models: dict[str, Path]
) -> None:
    """The text sent ends before the stop; `context` keeps the tokens the model wrote for it
    rather than tokenizing it anew (which gives the reply's first word a `▁`, a space the model
    never wrote)."""
    done = generate(served, model="plain", prompt="Say:", options={"stop": ["!"]})
    assert done["response"] == "Hello there"
    tok = tokenizer(models, "plain")
    context, n = done["context"], done["prompt_eval_count"]
    prompt = tok.decode(context[:n], skip_special_tokens=False)
    assert tok.decode(context, skip_special_tokens=False) == prompt + done["response"]
    assert [tok.id_to_token(t) for t in context[n:]] == ["Hello", "▁there"]


def test_a_context_sent_back_gets_no_second_bos(
    served: httpx.Client, models: dict[str, Path]
) -> None:
    """Ollama reads a `context` and the next prompt as one text: BOS opens it once."""
    bos = tokenizer(models, "plain").token_to_id(BOS)
    first = generate(served, model="plain", prompt="Say:")
    assert first["context"].count(bos) == 1
    again = generate(served, model="plain", prompt="Say:", context=first["context"])
    assert again["context"][: len(first["context"])] == first["context"]
    assert again["context"].count(bos) == 1
    # the context, then the prompt's tokens less its BOS
    assert again["prompt_eval_count"] == len(first["context"]) + first["prompt_eval_count"] - 1


def test_codellama_fills_in_the_middle_until_eot(served: httpx.Client) -> None:
    """CodeLlama's vocabulary spells its FIM pieces with the space before them (`▁<PRE>`): they
    make the model take a `suffix`, and a fill ends at `▁<EOT>`, not at EOS after it."""
    assert "insert" in post(served, "/api/show", model="codellama")["capabilities"]
    fim = {"model": "codellama", "prompt": "def f(n):\n    ", "suffix": "\n"}
    shown = post(served, "/api/generate", **fim, _debug_render_only=True)
    want = "\u2581<PRE> def f(n):\n    \u2581<SUF>\n\u2581<MID>"
    assert shown["_debug_info"]["rendered_template"] == want
    done = generate(served, **fim)
    assert done["response"] == "return n"
    assert done["done_reason"] == "stop"


def test_model_file_only_logprob_bytes_are_each_tokens_own(served: httpx.Client) -> None:
    """With `tokenizer.model` alone mlx-lm holds no piece table; the bytes still come from each
    piece: `▁w` is b" w", each of the emoji's byte pieces its own byte (not U+FFFD's)."""
    done = post(
        served,
        "/api/chat",
        model="model-only",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        options=GREEDY,
    )
    assert done["message"]["content"] == TEXT
    got = [bytes(lp["bytes"]) for lp in done["logprobs"]]
    assert got == [piece_bytes(p) for p in SPLIT.first]
    assert got[1] == b" w" and got[-4:] == [b"\xf0", b"\x9f", b"\x98", b"\x80"]
    assert b"".join(got).decode() == " " + TEXT


def test_context_after_a_stop_inside_a_token_adds_no_space() -> None:
    """A stop that cuts a token (`ld` of `▁wor ld`, stop "d"): the tail it leaves is read in
    its place, not alone (`▁l`, a space the model never wrote)."""
    from types import SimpleNamespace

    from transformers import PreTrainedTokenizerFast

    from mlxd.api.ollama import _continued
    from tests.fixtures.spm_models import spm_tokenizer

    script = Script("]", ("\u2581Hello", "\u2581wor", "ld"))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=spm_tokenizer(script), bos_token=BOS, eos_token="</s>"
    )
    out = tok.convert_tokens_to_ids(["\u2581Hello", "\u2581wor", "ld"])
    context = _continued(SimpleNamespace(output_tokens=out, stopped_text="Hello worl"), tok)
    assert tok.decode(context) == "Hello worl"
    assert context[:2] == out[:2]
