"""What a chat template says about a model's tool calls and thinking, read from the template's
text, never from the model's name: a fine-tune keeps its family's template, a renamed repo
keeps its template, and a template is what the model was trained to read and write."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from jinja2 import meta

from mlxd.engine.prompt import JINJA
from mlxd.registry.templates import is_go_template

HERMES = "hermes"  # Qwen2.5 / Qwen3 / Hermes: <tool_call>{json}</tool_call>
QWEN_XML = "qwen_xml"  # Qwen3-Coder / Qwen3.5: <tool_call><function=f><parameter=p>...
LLAMA3 = "llama3"  # Llama 3.1-3.3: a bare JSON object, or after <|python_tag|>
MISTRAL = "mistral"  # [TOOL_CALLS] [{...}] (or v11's name[ARGS]{...})
GRANITE = "granite"  # Granite 3.x: <|tool_call|>[{...}]
HARMONY = "harmony"  # gpt-oss: channels and recipients
JSON = "json"  # a template that takes tools but names no format: a bare JSON object


@dataclass(frozen=True)
class ThinkTags:
    open: str
    close: str


THINK = ThinkTags("<think>", "</think>")
MISTRAL_THINK = ThinkTags("[THINK]", "[/THINK]")


@dataclass(frozen=True)
class ChatFormat:
    """How one template renders tools and thinking, and how its model writes them back."""

    tools: str | None  # one of the formats above; None: the template never reads `tools`
    think: ThinkTags | None  # the tags around reasoning; harmony has channels instead
    harmony: bool = False
    think_switch: bool = False  # the template reads `enable_thinking`
    think_levels: bool = False  # the template reads `reasoning_effort` (low/medium/high)
    named_calls: bool = False  # Mistral v11+: a call is `[TOOL_CALLS]name[ARGS]{...}`

    @property
    def thinks(self) -> bool:
        return self.harmony or self.think is not None

    @property
    def capabilities(self) -> list[str]:
        caps = []
        if self.tools is not None:
            caps.append("tools")
        if self.thinks:
            caps.append("thinking")
        return caps


@functools.lru_cache(maxsize=64)
def _variables(template: str) -> frozenset[str] | None:
    """The names a template reads from its caller, or None when jinja cannot parse it.
    Remembered per template: parsing one costs ~20 ms, and every request asks."""
    try:
        return frozenset(meta.find_undeclared_variables(JINJA.parse(template)))
    except Exception:  # not Jinja this environment reads
        return None


def uses_tools(template: str) -> bool:
    """The template renders a `tools` (or Llama's `custom_tools`) argument."""
    names = _variables(template)
    if names is None:
        return re.search(r"\btools\b", template) is not None
    return bool(names & {"tools", "custom_tools"})


def _tool_format(template: str) -> str | None:
    if not uses_tools(template):
        return None
    if "<|channel|>" in template and "<|start|>" in template:
        return HARMONY
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|tool_call|>" in template:
        return GRANITE
    if "<tool_call>" in template:
        return QWEN_XML if "<function=" in template else HERMES
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3
    return JSON


def chat_format(template: str | None) -> ChatFormat:
    """What `template` says; Ollama's Go templates (which mlxd renders to the subset of
    `.System`, `.Prompt`, `.Response`) carry no tools and no thinking."""
    text = template or ""
    if is_go_template(text):
        text = ""
    harmony = "<|channel|>" in text and "<|start|>" in text and "<|message|>" in text
    think: ThinkTags | None = None
    if not harmony:
        if THINK.open in text and THINK.close in text:
            think = THINK
        elif MISTRAL_THINK.open in text and MISTRAL_THINK.close in text:
            think = MISTRAL_THINK
    return ChatFormat(
        tools=_tool_format(text),
        think=think,
        harmony=harmony,
        think_switch="enable_thinking" in text,
        think_levels="reasoning_effort" in text,
        named_calls="[ARGS]" in text,
    )


def model_format(template: str | None, tokenizer: Any) -> ChatFormat:
    """The format of what renders a model's prompts: its entry's own `template` (Jinja, or Go),
    else its tokenizer's chat template."""
    return chat_format(template or getattr(tokenizer, "chat_template", None))


def opens_thinking(prompt: str, tags: ThinkTags, prefill: str = "") -> bool:
    """The model's output starts inside its reasoning: the rendered prompt ends with the open
    tag (R1 distills, Qwen3-Thinking-2507), as Ollama decides (a user's message that mentions
    the tag opens nothing), or the assistant text it continues (`prefill`) left a block open."""
    if prefill:
        return prefill.rfind(tags.open) > prefill.rfind(tags.close)
    return prompt.rstrip().endswith(tags.open)
