"""Checks on the shipped ``tiny`` pairing in ``registry/embedded/tiny``.

The pairing is the offline default (``mlxd run tiny``), so a broken or retrained
checkpoint must fail fast here: it has to load through the same ``mlx_lm.load``
path as pulled models, its draft must share the target's tokenizer (speculative
decoding compares token ids), and it must still produce code-looking text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import generate, load

ROOT = Path(__file__).resolve().parents[1] / "registry" / "embedded" / "tiny"
TARGET = ROOT / "target"
DRAFT = ROOT / "draft"
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
)
PY_KEYWORDS = (
    "return",
    "if",
    "else",
    "for",
    "in",
    "not",
    "def",
    "self",
    "None",
    "import",
    "raise",
    "while",
    "is",
    "and",
    "or",
    "try",
    "except",
    "with",
    "yield",
    "elif",
    "True",
    "False",
    "pass",
    "class",
    "lambda",
    "from",
    "as",
)

pytestmark = pytest.mark.skipif(
    not (TARGET / "model.safetensors").is_file(),
    reason="embedded tiny weights not built (python -m tools.embedded_train)",
)


@pytest.fixture(scope="module")
def target() -> tuple[Any, Any]:
    """Target model and tokenizer, loaded once: loading is the slow part."""
    loaded = load(str(TARGET))
    return loaded[0], loaded[1]


@pytest.fixture(scope="module")
def draft() -> tuple[Any, Any]:
    """Draft model and tokenizer, loaded once."""
    loaded = load(str(DRAFT))
    return loaded[0], loaded[1]


def _json(path: Path) -> dict[str, Any]:
    """Read a JSON file from the pairing."""
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def test_pairing_is_small() -> None:
    """The weights ship in git, so the folder must stay a few MB."""
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    assert total < 8_000_000


@pytest.mark.parametrize("folder", [TARGET, DRAFT])
def test_config_shape(folder: Path) -> None:
    """Config carries the HF fields loaders and the daemon rely on."""
    cfg = _json(folder / "config.json")
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert set(cfg["eos_token_id"]) == {0, 2}
    assert set(_json(folder / "generation_config.json")["eos_token_id"]) == {0, 2}


def test_draft_is_smaller() -> None:
    """A draft only pays off when it is much cheaper than the target."""
    sizes = {f: (f / "model.safetensors").stat().st_size for f in (TARGET, DRAFT)}
    assert sizes[DRAFT] * 2 < sizes[TARGET]


def test_loads_and_shares_tokenizer(target: tuple[Any, Any], draft: tuple[Any, Any]) -> None:
    """Speculative decoding compares ids, so both vocabularies must be identical."""
    t_model, t_tok = target
    d_model, d_tok = draft
    assert t_tok.vocab_size == d_tok.vocab_size
    assert t_tok.get_vocab() == d_tok.get_vocab()
    assert t_model.args.vocab_size == d_model.args.vocab_size
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    assert t_tok.encode(text) == d_tok.encode(text)


def test_eos_ids(target: tuple[Any, Any], draft: tuple[Any, Any]) -> None:
    """<|im_end|> ends chat turns and <|endoftext|> ends raw completions."""
    for _, tok in (target, draft):
        assert set(tok.eos_token_ids) == {0, 2}
        assert tok.eos_token == "<|im_end|>"


def test_special_tokens(target: tuple[Any, Any]) -> None:
    """ChatML and FIM markers have the fixed ids the engine's prompt builders use."""
    _, tok = target
    for tid, text in enumerate(SPECIALS):
        assert tok.convert_tokens_to_ids(text) == tid
        assert tok.encode(text) == [tid]


def test_chatml_template(target: tuple[Any, Any]) -> None:
    """The chat template renders ChatML with an assistant generation prompt."""
    _, tok = target
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_fim_prompt_encodes(target: tuple[Any, Any]) -> None:
    """A PSM fill-in-the-middle prompt tokenizes with its markers as single tokens."""
    _, tok = target
    ids = tok.encode("<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y\n<|fim_middle|>")
    assert ids[0] == 3
    assert 4 in ids
    assert ids[-1] == 5


def test_greedy_completion_looks_like_python(target: tuple[Any, Any]) -> None:
    """The trained target continues a def with an indented body using Python words."""
    model, tok = target
    mx.random.seed(0)
    text = generate(model, tok, "def fib(n):", max_tokens=48)
    assert re.search(r"\n[ \t]+\S", text), text
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert words & set(PY_KEYWORDS), text
