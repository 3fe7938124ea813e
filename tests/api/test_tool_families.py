"""Tool calls and thinking where a family's own way of writing them once went wrong: Mistral v11's
`name[ARGS]{...}` calls under the tool grammar, Qwen3.5's call inside its reasoning, Llama 3's
several calls sent back, a user's `<think>` text, and a call marker inside an argument's
string, Granite's `<|tool_call|>` calls. Scripted models write each family's markers, served by
one real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import RunningServer, ServerThread
from tests.fixtures.scripted_models import Script, build_scripted
from tests.tools.conftest import WEATHER

RUN = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run Python code",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS, ROME = {"city": "Paris"}, {"city": "Rome"}
V11_CALL = ("[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "', "Paris", '"}')
QWEN35_THOUGHT = "I need the weather; a <tool_call> tag would call it."
LLAMA3_CALLS = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_weather", "parameters": {"city": "Rome"}}'
)

# name: (family, script)
MODELS: dict[str, tuple[str, Script]] = {
    # the arguments in several tokens, as a real model writes them
    "v11": ("mistral_v11", Script("[/INST]", V11_CALL)),
    # a script writes a token once: where the user says "twice" it calls, then writes text the
    # grammar bars after a call; of what it allows (a call's marker, the end) the script's first
    # token wins, so the model calls again, and again
    "v11-again": ("mistral_v11", Script("[/INST]", ("Sure.",), (*V11_CALL, "Done."), "twice")),
    "v11-marker": ("mistral_v11", Script(
        "[/INST]", ("[TOOL_CALLS]", "run", "[ARGS]", '{"code": "', "s = '[TOOL_CALLS]'", '"}'),
    )),
    # the prompt opened `<think>`; the call comes before any `</think>`, after a mention of the
    # call's tag (split where the splitter must wait to tell) that stays reasoning
    "qwen35": ("qwen35", Script(
        "\n", ("I need the weather; a <tool_call>", " tag would call it.\n", "<tool_call>",
               "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
               "</tool_call>"),
    )),
    "llama3-two": ("llama3", Script("\n", (LLAMA3_CALLS,))),
    # the generation prompt opens `<think>`: the reply starts inside the reasoning
    "r1": ("r1", Script("\n", ("Two and two.", "</think>", "\n\nFour."))),
    "qwen3-think": ("qwen3", Script(
        "\n", ("<think>", "\nHmm.\n", "</think>", "\n\nIt marks reasoning."),
    )),
    # Granite 3.x: its marker token, then a JSON array, the arguments in several tokens
    "granite": ("granite", Script(
        "<|end_of_role|>", ("<|tool_call|>", '[{"name": "get_weather", "arguments": {"city": "',
                            "Paris", '"}}]'),
    )),
    "hermes-marker": ("qwen2_5", Script(
        "\n", ("<tool_call>", '\n{"name": "run", "arguments": ', '{"code": "',
               "print('</tool_call>')", '"}', "}\n", "</tool_call>"),
    )),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for the module, serving every scripted model above."""
    root = tmp_path_factory.mktemp("families")
    lines = ["models:"]
    for name, (family, script) in MODELS.items():
        path = build_scripted(root / name, family, script)
        lines.append(f"  {name}:\n    target: {path}\n    options:\n      temperature: 0")
    registry = root / "models.yaml"
    registry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with ServerThread(registry, max_loaded=len(MODELS)) as info:
        yield info


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


Calls = list[tuple[str, Any]]
Reply = tuple[str, str, Calls]  # content, thinking, calls (name, arguments)
WAYS = ["ollama", "ollama-stream", "openai", "openai-stream"]


def ask(http: httpx.Client, way: str, model: str, limit: int = 0, **body: Any) -> Reply:
    """One greedy chat request `way`, streamed or whole, on either API, of at most `limit`
    tokens where set; the reply's parts. (OpenAI's temperature is 1 unless asked.)"""
    body = {"model": model, "messages": USER, **body, "stream": way.endswith("-stream")}
    if way.startswith("ollama"):
        options = {"temperature": 0, **({"num_predict": limit} if limit else {})}
        return _ollama(http, {**body, "options": options})
    return _openai(http, {**body, "temperature": 0, **({"max_tokens": limit} if limit else {})})


def _ollama(http: httpx.Client, body: dict[str, Any]) -> Reply:
    r = http.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines() if line]
    assert lines[-1]["done"] is True
    messages = [line["message"] for line in lines]
    content = "".join(m["content"] for m in messages)
    thinking = "".join(m.get("thinking", "") for m in messages)
    calls = [c["function"] for m in messages for c in m.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    return content, thinking, [(c["name"], c["arguments"]) for c in calls]


def _openai(http: httpx.Client, body: dict[str, Any]) -> Reply:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not body["stream"]:
        message = r.json()["choices"][0]["message"]
        calls = [c["function"] for c in message.get("tool_calls") or []]
        parts = [(c["name"], json.loads(c["arguments"])) for c in calls]
        return message["content"] or "", message.get("reasoning_content") or "", parts
    content, thinking = "", ""
    pieces: dict[int, tuple[str, str]] = {}
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            thinking += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                name, args = pieces.get(call["index"], ("", ""))
                function = call["function"]
                pieces[call["index"]] = (
                    name + (function.get("name") or ""),
                    args + (function.get("arguments") or ""),
                )
    return content, thinking, [(n, json.loads(a)) for n, a in pieces.values()]


@pytest.mark.parametrize("way", WAYS)
def test_mistral_v11_call_comes_back_under_the_grammar(http: httpx.Client, way: str) -> None:
    """Declared tools constrain v11's calls to `[TOOL_CALLS]name[ARGS]{...}`, not the older
    `[TOOL_CALLS][{...}]` array, which derailed a model writing its own form."""
    assert ask(http, way, "v11", tools=[WEATHER]) == ("", "", [("get_weather", PARIS)])


@pytest.mark.parametrize("way", WAYS)
def test_granite_calls_come_back_as_calls(http: httpx.Client, way: str) -> None:
    """Granite's template teaches `<|tool_call|>[{...}]`: a call (it came back as content,
    marker and all, under the generic JSON format), held to the tool's schema once the marker
    opens it."""
    assert ask(http, way, "granite", tools=[WEATHER]) == ("", "", [("get_weather", PARIS)])


@pytest.mark.parametrize("way", WAYS)
def test_mistral_v11_calls_may_follow_one_another(http: httpx.Client, way: str) -> None:
    """After a call, the grammar allows another `[TOOL_CALLS]` (and nothing else but the end),
    and `[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}` is two calls. The scripted model
    writes the same call again and again (see its script): 12 tokens are two calls."""
    messages = [{"role": "user", "content": "The weather in Paris, twice?"}]
    reply = ask(http, way, "v11-again", 12, messages=messages, tools=[WEATHER])
    assert reply == ("", "", [("get_weather", PARIS), ("get_weather", PARIS)])


@pytest.mark.parametrize("way", WAYS)
def test_qwen35_call_before_the_close_of_thinking_is_a_call(http: httpx.Client, way: str) -> None:
    """`<tool_call>` then `<function=` ends Qwen3.5's reasoning without a `</think>`; the tag
    mentioned in the reasoning, not followed by `<function=`, stays reasoning."""
    got = ask(http, way, "qwen35", tools=[WEATHER])
    assert got == ("", QWEN35_THOUGHT, [("get_weather", PARIS)])


def test_qwen35_reply_with_a_call_finishes_as_tool_calls(http: httpx.Client) -> None:
    body = {"model": "qwen35", "messages": USER, "tools": [WEATHER], "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_llama3_several_calls_go_back_a_turn_each(http: httpx.Client) -> None:
    """Llama 3's template refuses an assistant turn of several calls, which its own reply of
    `;`-separated calls is: sent back with its results, each call is a turn followed by its
    result."""
    body = {"model": "llama3-two", "messages": USER, "tools": [WEATHER], "stream": False}
    reply = http.post("/api/chat", json=body).json()["message"]
    assert [c["function"]["arguments"] for c in reply["tool_calls"]] == [PARIS, ROME]
    results = [
        {"role": "tool", "content": temp, "tool_name": "get_weather"} for temp in ("18C", "25C")
    ]
    body = {**body, "messages": [*USER, reply, *results], "_debug_render_only": True}
    r = http.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    turn = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    result = "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"
    paris, rome = LLAMA3_CALLS.split("; ")
    expected = f'{turn}{paris}{result}"18C"<|eot_id|>{turn}{rome}{result}"25C"<|eot_id|>{turn}'
    assert r.json()["_debug_info"]["rendered_template"].endswith(expected)


def test_llama3_several_calls_go_back_on_openai(http: httpx.Client) -> None:
    """The same history in OpenAI's shape, its results sent in another order than the calls:
    each follows the call whose id it names."""
    calls = [
        {"id": f"call_{n}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(args)}}
        for n, args in enumerate((PARIS, ROME))
    ]  # fmt: skip
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "25C"},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
    ]
    body = {"model": "llama3-two", "messages": messages, "tools": [WEATHER], "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    shown = http.post(
        "/api/chat", json={**body, "stream": False, "_debug_render_only": True}
    ).json()["_debug_info"]["rendered_template"]
    paris, rome = shown.index('"Paris"'), shown.index('"Rome"')
    assert paris < shown.index("18C") < rome < shown.index("25C")


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("text", ["What does the <think> tag do?", "What does <think> do?\n"])
def test_a_users_think_text_opens_no_block(http: httpx.Client, way: str, text: str) -> None:
    """`<think>` in the user's message is the user's text: the reply's own block is the
    reasoning, its tag no part of it (also where the template trims the message)."""
    got = ask(http, way, "qwen3-think", messages=[{"role": "user", "content": text}])
    assert got == ("It marks reasoning.", "Hmm.", [])


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("text", ["hi", "think", "What is 2 + 2?"])
def test_a_prompt_that_opens_the_block_starts_the_reply_in_it(
    http: httpx.Client, way: str, text: str
) -> None:
    """R1's generation prompt ends in `<think>`: the reply starts inside the reasoning, whatever
    the user wrote (a message whose letters occur in the tag, "hi", once hid it)."""
    got = ask(http, way, "r1", messages=[{"role": "user", "content": text}])
    assert got == ("Four.", "Two and two.", [])


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(
    ("model", "code"),
    [("hermes-marker", "print('</tool_call>')"), ("v11-marker", "s = '[TOOL_CALLS]'")],
)
def test_a_marker_inside_an_argument_string_is_text(
    http: httpx.Client, way: str, model: str, code: str
) -> None:
    """Code holding the family's own call marker: the marker inside the JSON string neither
    ends the call (Hermes' `</tool_call>`) nor splits it (Mistral's `[TOOL_CALLS]`)."""
    assert ask(http, way, model, tools=[RUN]) == ("", "", [("run", {"code": code})])
