"""The reply parsers without a model: every way of cutting the text into pieces gives the same
parts, a marker is never given out as content, and what does not parse stays content."""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.chatformat import HERMES, JSON, LLAMA3, MISTRAL, QWEN_XML, THINK, chat_format
from mlxd.api.harmony import HarmonyParser
from mlxd.api.reply import Parser, Reply, ReplyParser
from mlxd.api.thinking import ThinkSplitter
from mlxd.api.tools import ToolCallParser, mistral_id
from tests.fixtures.scripted_models import TEMPLATES

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "at": {"type": ["number", "null"]}, "hours": {"type": "array"},
    },
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]
PARIS = {"city": "Paris"}


def parts(make: Any, text: str, cut: int) -> tuple[str, str, list[tuple[str, Any]]]:
    """Feed `text` in pieces of `cut` characters; (content, thinking, calls)."""
    parser: Parser = make()
    reply = Reply()
    for i in range(0, len(text), cut):
        reply.add(parser.feed(text[i : i + cut]))
    reply.add(parser.finish())
    calls = [(c.name, c.arguments) for c in reply.calls]
    assert [c.index for c in reply.calls] == list(range(len(calls)))
    return "".join(reply.content), "".join(reply.thinking), calls


def same_for_every_cut(make: Any, text: str) -> tuple[str, str, list[tuple[str, Any]]]:
    whole = parts(make, text, len(text) or 1)
    for cut in range(1, 9):
        assert parts(make, text, cut) == whole, cut
    return whole


CASES = [
    (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Sure. ", [("get_weather", PARIS)]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> done',
     "\n done", [("get_weather", PARIS), ("get_time", {})]),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no end tag
     "", [("get_weather", PARIS)]),
    (HERMES, "a < b and <tool_ca", "a < b and <tool_ca", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [("get_weather", PARIS)]),
    (LLAMA3, ' {"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', "", [("get_weather", PARIS), ("get_time", {})]),
    (LLAMA3, 'The JSON is {"name": "get_weather"}', 'The JSON is {"name": "get_weather"}', []),
    (LLAMA3, '{"a": 1}', '{"a": 1}', []),
    (MISTRAL, 'Ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', "Ok ", [("get_weather", PARIS), ("get_time", {})]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", PARIS), ("get_time", {})]),
    (MISTRAL, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (JSON, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", PARIS)]),
    (JSON, "Plain {text}", "Plain {text}", []),
    (QWEN_XML, 'Ok <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
     '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>',
     "Ok ", [("get_weather", {"city": "Paris", "days": 3})]),
    # XML values convert by the tool's schema: a string stays text, whatever it looks like
    (QWEN_XML, '<tool_call>\n<function=get_weather>\n<parameter=city>\n2024\n</parameter>\n'
     '<parameter=metric>\ntrue\n</parameter>\n<parameter=at>\nnull\n</parameter>\n'
     '<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>', "",
     [("get_weather", {"city": "2024", "metric": True, "at": None, "hours": [1, 2]})]),
    (QWEN_XML, '<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n'
     '<parameter=at>\n1.5\n</parameter>\n<parameter=note>\n{"a": 1}\n</parameter>\n'
     '</function>\n</tool_call>', "",
     [("get_weather", {"days": "three", "at": 1.5, "note": '{"a": 1}'})]),
    # a JSON call whose argument text holds `<function=` is still a JSON call
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a <function=f> b"}}\n'
     '</tool_call>', "", [("get_weather", {"city": "a <function=f> b"})]),
    # the end marker inside an argument's string does not end the call
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call>"}}\n'
     '</tool_call>', "", [("get_weather", {"city": "</tool_call>"})]),
    # a quote the call never closes: its end marker ends it after all, the next call parses
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a"b"}}\n</tool_call>'
     '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a"b"}}\n</tool_call>\n\nDone.',
     [("get_time", {})]),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_tool_calls(fmt: str, text: str, content: str, calls: list[Any]) -> None:
    got = same_for_every_cut(lambda: ToolCallParser(fmt, TOOLS), text)
    assert got == (content, "", calls)


def test_markers_never_leak_while_streaming() -> None:
    parser = ToolCallParser(HERMES, TOOLS)
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    given = [p for ch in text for p in parser.feed(ch)] + parser.finish()
    content = "".join(getattr(p, "text", "") for p in given)
    assert content == "Hi "


@pytest.mark.parametrize(
    ("text", "inside", "thinking", "content"),
    [
        ("<think>\nhmm\n</think>\n\nYes.", False, "hmm", "Yes."),
        ("  <think>a</think>b", False, "a", "b"),
        ("No thinking here <think>x</think>", False, "", "No thinking here <think>x</think>"),
        ("reasoning\n</think>\n\nanswer", True, "reasoning", "answer"),
        ("never closed", True, "never closed", ""),
        ("<thin", False, "", "<thin"),
    ],
)
def test_think_split(text: str, inside: bool, thinking: str, content: str) -> None:
    got = same_for_every_cut(lambda: ThinkSplitter(THINK, inside), text)
    assert got == (content, thinking, [])


def test_thinking_then_calls() -> None:
    """Reasoning is split first: a call written while thinking is not run."""
    text = (
        '<think>maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call></think>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )
    got = same_for_every_cut(
        lambda: ReplyParser(ThinkSplitter(THINK), ToolCallParser(HERMES, TOOLS)), text
    )
    assert got[2] == [("get_weather", PARIS)]
    assert "get_time" in got[1]


def test_harmony() -> None:
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>'
    )
    got = same_for_every_cut(lambda: HarmonyParser(TOOLS), text)
    assert got == ("", "Need weather.", [("get_weather", PARIS)])
    final = (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4"
    )
    assert same_for_every_cut(lambda: HarmonyParser(None), final) == ("4", "Easy.", [])


def test_formats_detected_from_the_templates() -> None:
    def fmt(name: str) -> Any:
        return chat_format((TEMPLATES / name).read_text())

    assert (fmt("qwen2_5.jinja").tools, fmt("qwen2_5.jinja").think) == (HERMES, None)
    assert fmt("qwen3.jinja").tools == HERMES and fmt("qwen3.jinja").think_switch
    assert fmt("llama3_3.jinja").tools == LLAMA3
    assert fmt("mistral_nemo.jinja").tools == MISTRAL
    assert fmt("generic_tools.jinja").tools == JSON
    r1 = fmt("deepseek_r1_distill.jinja")
    assert r1.tools is None and r1.think == THINK
    assert chat_format(None).capabilities == []
    coder = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n<function=name>"
    assert chat_format(coder).tools == QWEN_XML


def test_mistral_ids() -> None:
    assert mistral_id("abcDEF123") == "abcDEF123"
    made = mistral_id("call_x1y2z3w4")
    assert len(made) == 9 and made.isalnum() and made == mistral_id("call_x1y2z3w4")
