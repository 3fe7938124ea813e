"""Scripted models of each template family, served by one real server for this package."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningServer, ServerThread
from tests.fixtures.scripted_models import Script, build_scripted
from tests.fixtures.tiny_models import TinyPair

# litellm fetches a model cost map from the network at import unless told to use its own copy.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

CALL_ARGS = {"city": "Paris"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
ANSWER = "It is 18 degrees in Paris."
THOUGHT = "The user asks about the sky."
BLUE = "It is blue."
MUSED = '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'

# name: (family, script); each writes its family's markers as the template taught them
MODELS: dict[str, tuple[str, Script]] = {
    "qwen3-tools": ("qwen3", Script(
        "\n",
        ("Let me check. ", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": ',
         '{"city": ', '"Paris"}', "}\n", "</tool_call>"),
        (ANSWER,),
        "<tool_response>",
    )),
    "qwen25-tools": ("qwen2_5", Script(
        "\n", ("<tool_call>", '\n{"name": "get_weather", "arguments": ', '{"city": ', '"Paris"}',
               "}\n", "</tool_call>"),
    )),
    "llama3-tools": ("llama3", Script(
        "\n", ("<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": "Paris"}}'),
    )),
    "llama3-json": ("llama3", Script(
        "\n", ('{"name": "get_weather", "parameters": {"city": "Paris"}}',),
    )),
    "mistral-tools": ("mistral", Script(
        "[/INST]", ("[TOOL_CALLS]", '[{"name": "get_weather", "arguments": ',
                    '{"city": ', '"Paris"}', "}]"),
    )),
    "generic-tools": ("generic", Script(
        "\n", ('{"name": "get_weather", ', '"arguments": {"city": "Paris"}}'),
    )),
    "qwen3-think": ("qwen3", Script(
        "\n", ("<think>", "\n" + THOUGHT + "\n", "</think>", "\n\n" + BLUE),
    )),
    "r1": ("r1", Script("\n", ("Two plus two", " is four.", "</think>", "\n\nThe answer is 4."))),
    # drafts a call while it reasons, then answers: the tools' grammar leaves its reasoning free
    "qwen3-muses": ("qwen3", Script(
        "\n", ("<think>", "\nI might call ", "<tool_call>", MUSED, "</tool_call>", "\nno.",
               "</think>", "\n\n" + BLUE),
    )),
    # formats whose free replies are not constrained (no call marker): malformed calls happen
    "llama3-badjson": ("llama3", Script(
        "\n", ('{"name": "get_weather", ', '"parameters": {"city": '),
    )),
    "generic-unknown": ("generic", Script(
        "\n", ('{"name": "launch_rocket", ', '"arguments": {}}'),
    )),
    # never calls on its own: tool_choice must force it
    "talker": ("qwen2_5", Script("\n", ("I would rather chat.",))),
}  # fmt: skip


@pytest.fixture(scope="session")
def scripted(tmp_path_factory: pytest.TempPathFactory, tiny_pair: TinyPair) -> Path:
    """The registry of every scripted model (and the plain `tiny`, whose template has no
    tools)."""
    root = tmp_path_factory.mktemp("scripted")
    lines = ["models:", f"  tiny:\n    target: {tiny_pair.target}"]
    for name, (family, script) in MODELS.items():
        path = build_scripted(root / name, family, script)
        lines.append(f"  {name}:\n    target: {path}\n    options:\n      temperature: 0")
    registry = root / "models.yaml"
    registry.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return registry


@pytest.fixture(scope="session")
def server(scripted: Path) -> Iterator[RunningServer]:
    with ServerThread(scripted, max_loaded=4) as info:
        yield info
