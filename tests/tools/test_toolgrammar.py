"""The tool-call grammars on real tokenizers: a model's native call passes the mask token by
token; text where a call must be, an undeclared tool or arguments off the schema do not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load

from mlxd.api.chatformat import chat_format
from mlxd.api.toolgrammar import AUTO, REQUIRED, tool_grammar, with_layout
from mlxd.engine.grammar import Matcher
from tests.fixtures.scripted_models import build_scripted
from tests.tools.conftest import CITY, MODELS, WEATHER


def matcher(path: Path, choice: str, tools: list[Any]) -> tuple[Matcher, Any]:
    _, tok = load(str(path))
    spec = tool_grammar(chat_format(tok.chat_template), tok, tools, choice, False)
    assert spec is not None
    vocab = 1 + max(tok.get_vocab().values())
    return Matcher.build(spec, tok, vocab, sorted(tok.eos_token_ids)), tok


def masked_walk(m: Matcher, ids: list[int]) -> int:
    """How many of `ids` the mask allows in a row."""
    for n, i in enumerate(ids):
        bits = m.bits()
        m.mask_into(bits[0])
        if not (bits[0][i // 32] >> (i % 32)) & 1 or m.consume([i]) != 1:
            return n
    return len(ids)


@pytest.mark.parametrize("model", ["qwen3-tools", "qwen25-tools", "mistral-tools"])
@pytest.mark.parametrize("choice", [AUTO, REQUIRED, "get_weather"])
def test_native_calls_pass_the_mask(tmp_path: Path, model: str, choice: str) -> None:
    family, script = MODELS[model]
    path = build_scripted(tmp_path / model, family, script)
    m, tok = matcher(path, choice, [WEATHER])
    pieces = [p for p in script.first if choice == AUTO or p != "Let me check. "]
    ids = [tok.encode(p, add_special_tokens=False)[0] for p in pieces]
    assert masked_walk(m, ids) == len(ids)
    assert m.accepting


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ("I would rather chat.", REQUIRED),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', AUTO),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>', AUTO),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Rome"}}\n</tool_call>', AUTO),
    ],
)
def test_what_the_grammar_refuses(tmp_path: Path, text: str, choice: str) -> None:
    path = build_scripted(tmp_path / "talker", *MODELS["talker"])
    m, tok = matcher(path, choice, [CITY])
    ids = tok.encode(text, add_special_tokens=False)
    assert masked_walk(m, ids) < len(ids)


def test_a_tool_whose_schema_cannot_be_compiled_takes_any_arguments(tmp_path: Path) -> None:
    """`uniqueItems` (MCP tools carry such keywords): the request is not refused, that tool's
    arguments are any JSON object, the others' still held to their schemas."""
    tags = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}},
    }}}  # fmt: skip
    family, script = MODELS["qwen25-tools"]
    path = build_scripted(tmp_path / "m", family, script)
    m, tok = matcher(path, AUTO, [tags])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert masked_walk(m, ids) == len(ids)


def test_a_schemas_own_layout_wins() -> None:
    body = json.loads(with_layout({"type": "object", "x-guidance": {"key_separator": ":"}}))
    assert body["x-guidance"]["key_separator"] == ":"
    assert body["x-guidance"]["item_separator"] == ", "


def test_a_required_call_after_thinking_comes_within_a_few_characters(tmp_path: Path) -> None:
    """Whitespace between the reasoning and the call it must make is bounded: a model that
    would rather not call wrote tabs until the limit (3,555 tokens), never the call."""
    family, script = MODELS["qwen3-tools"]
    path = build_scripted(tmp_path / "thinker", family, script)
    m, tok = matcher(path, REQUIRED, [WEATHER])
    thought = tok.encode("<think>\nNo call.\n</think>", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    assert masked_walk(m, thought + newline * 8) == len(thought) + 8
    m, _ = matcher(path, REQUIRED, [WEATHER])
    assert masked_walk(m, thought + newline * 9) == len(thought) + 8
