"""A chat request rendered for the model that serves it: tools and thinking handed to its chat
template the way that template reads them, and the parser its reply goes through.

What the template supports is known only once the model is loaded (a registry entry may bring
its own template), so the checks that depend on it run in `ChatPrompt.__call__`, inside
`prepare`, which releases the model when they fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxd.api.chatformat import LLAMA3, MISTRAL, ChatFormat, model_format, opens_thinking
from mlxd.api.errors import ApiError
from mlxd.api.reply import Parser, Plain, reply_parser
from mlxd.api.toolgrammar import AUTO, after_thinking, tool_grammar
from mlxd.api.tools import mistral_id, template_calls, tool_names
from mlxd.engine.grammar import GrammarError, GrammarSpec, validate
from mlxd.engine.pairing import Pairing
from mlxd.engine.prompt import continued, go_template, render_chat
from mlxd.registry.schema import ModelEntry

THINK_LEVELS = ("low", "medium", "high", "max")


@dataclass(frozen=True)
class Think:
    """A request's thinking, resolved against the model: on or off, and a level if one was
    asked for."""

    on: bool
    level: str | None = None


def check_think_value(think: bool | str | None) -> None:
    if think is None or isinstance(think, bool) or think in THINK_LEVELS:
        return
    raise ApiError(400, "invalid think value")


def resolve_think(think: bool | str | None, fmt: ChatFormat, name: str) -> Think:
    """As Ollama: unset means on for a model that thinks; `true` or a level on a model that
    cannot is a 400; `false` is always accepted."""
    check_think_value(think)
    if think is None:
        return Think(fmt.thinks)
    if think is False:
        return Think(False)
    if not fmt.thinks:
        raise ApiError(400, f'"{name}" does not support thinking')
    return Think(True, think if isinstance(think, str) else None)


def template_kwargs(fmt: ChatFormat, think: Think) -> dict[str, Any]:
    """What the template reads about thinking: Qwen3's switch, gpt-oss's effort level."""
    out: dict[str, Any] = {}
    if fmt.think_switch:
        out["enable_thinking"] = think.on
    if fmt.think_levels:
        level = think.level or ("medium" if think.on else "low")
        out["reasoning_effort"] = "high" if level == "max" else level
    return out


def template_messages(messages: Sequence[dict[str, Any]], fmt: ChatFormat) -> list[dict[str, Any]]:
    """Messages as HF templates read them: call arguments as objects, reasoning under the key
    the template reads, a tool result's name and the id of the call it answers."""
    mistral = fmt.tools == MISTRAL
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant calls not yet answered, in order
    for msg in messages:
        m = dict(msg)
        if m.get("tool_calls"):
            m["tool_calls"] = template_calls(m["tool_calls"], mistral)
            pending = [c.get("id", "") for c in m["tool_calls"]]
        elif "tool_calls" in m:
            del m["tool_calls"]
        if m.get("thinking"):
            m["reasoning_content"] = m["thinking"]
        if m["role"] == "tool":
            if m.get("tool_name"):
                m.setdefault("name", m["tool_name"])
            ident = m.get("tool_call_id") or (pending[0] if pending else "")
            if pending:
                pending.pop(0)
            if ident:
                m["tool_call_id"] = mistral_id(ident) if mistral else ident
        out.append(m)
    return _one_call_a_turn(out) if fmt.tools == LLAMA3 else out


def _one_call_a_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Llama 3.1's template renders one call per assistant turn and refuses a turn of several
    ("only supports single tool-calls at once"), which the model's own reply of `;`-separated
    calls is: such a turn goes in as a turn per call, each followed by its result (by the id
    it answers where the results name them, else in order)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        i += 1
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        results: list[dict[str, Any]] = []
        while i < len(messages) and messages[i].get("role") == "tool" and len(results) < len(calls):
            results.append(messages[i])
            i += 1
        by_id = {r.get("tool_call_id"): r for r in results}
        answered = [by_id.get(call.get("id")) for call in calls]
        distinct = len({id(r) for r in answered}) == len(calls)
        if len(results) == len(calls) and all(answered) and distinct:
            results = [r for r in answered if r is not None]
        for n, call in enumerate(calls):
            out.append(
                {**m, "tool_calls": [call]}
                if n == 0
                else {"role": "assistant", "content": "", "tool_calls": [call]}
            )
            out.extend(results[n : n + 1])
    return out


class ChatPrompt:
    """Renders one chat request for a loaded pairing; afterwards `parser()` gives the parser
    its reply goes through and `grammar` the constraint on its tool calls (`choice`: AUTO,
    REQUIRED, or the name of the one tool in `tools`)."""

    def __init__(
        self,
        entry: ModelEntry,
        messages: list[dict[str, Any]],
        tools: Sequence[Any] | None,
        think: bool | str | None,
        choice: str = AUTO,
        answer_format: GrammarSpec | None = None,
    ) -> None:
        """`answer_format`: the request's structured output (`format`, `response_format`,
        `options.grammar`), held by the reply after any thinking (`after_thinking`); it
        takes the place of the tools' grammar."""
        check_think_value(think)
        tool_names(tools)  # a malformed tool is a 400 before the model is loaded
        self.entry = entry
        self.messages = messages
        self.tools = list(tools) if tools else None
        self.think_value = think
        self.think = Think(False)
        self.choice = choice
        self.answer_format = answer_format
        self.grammar: GrammarSpec | None = answer_format
        self._parser: Any = Plain

    def __call__(self, pairing: Pairing) -> str:
        fmt = model_format(self.entry.template, pairing.tokenizer)
        if self.tools and fmt.tools is None:
            raise ApiError(400, f"{self.entry.name} does not support tools")
        self.think = resolve_think(self.think_value, fmt, self.entry.name)
        seeded = [dict(m) for m in self.entry.messages] + self.messages  # MESSAGE lines first
        # the model's SYSTEM, unless the request opens with its own (as Ollama decides it:
        # on the request's messages, not on the seed's)
        own = bool(self.messages) and self.messages[0].get("role") == "system"
        messages = template_messages(seeded, fmt)
        if self.entry.system and not own:
            messages.insert(0, {"role": "system", "content": self.entry.system})
        text = render_chat(
            pairing.tokenizer, messages, self.tools, template_kwargs(fmt, self.think),
            go_template(self.entry.template),
        )  # fmt: skip
        think, tools = self.think.on, self.tools
        prefill = continued(self.messages)
        self._parser = lambda: reply_parser(fmt, text, think, tools, prefill)
        inside = fmt.think is not None and think and opens_thinking(text, fmt.think, prefill)
        if self.answer_format is not None:
            self.grammar = after_thinking(self.answer_format, fmt, pairing.tokenizer, think, inside)
        elif tools:
            self.grammar = tool_grammar(fmt, pairing.tokenizer, tools, self.choice, inside)
            self._validate()
        return text

    def _validate(self) -> None:
        """A tool whose parameters are not a schema the grammar takes is the request's fault."""
        if self.grammar is None:
            return
        try:
            validate(self.grammar)
        except GrammarError as exc:
            raise ApiError(400, f"invalid tool parameters: {exc}") from exc

    def parser(self) -> Parser:
        """A fresh parser for the reply (each call starts from the beginning)."""
        return self._parser()
