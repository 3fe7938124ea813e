"""A model's reply as a client receives it: content, thinking and tool calls, streamed or whole.

Reasoning is split off first, then tool calls are parsed out of what remains, so a call the
model only considered while thinking is never run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxd.api.chatformat import QWEN_XML, ChatFormat, opens_thinking
from mlxd.api.harmony import HarmonyParser
from mlxd.api.thinking import CONTENT, THINKING, Piece, ThinkSplitter
from mlxd.api.tools import ToolCall, ToolCallParser

Part = Piece | ToolCall


class Parser(Protocol):
    def feed(self, text: str) -> list[Part]: ...

    def finish(self) -> list[Part]: ...


def with_held(parts: list[Part], held: Sequence[Any]) -> list[Part]:
    """The parser's last parts, or an empty content part where it has none but tokens read
    since the last part (`held`: their log-probabilities) still have to go out: a streamed
    reply reports every token's log-probability, as the whole one does."""
    return parts if parts or not held else [Piece(CONTENT, "")]


class Plain:
    """No tools, no thinking: text is content."""

    def feed(self, text: str) -> list[Part]:
        return [Piece(CONTENT, text)] if text else []

    def finish(self) -> list[Part]:
        return []


class ReplyParser:
    def __init__(self, think: ThinkSplitter | None, tools: ToolCallParser | None) -> None:
        self.think = think
        self.tools = tools

    def _route(self, pieces: list[Piece]) -> list[Part]:
        out: list[Part] = []
        for piece in pieces:
            if piece.kind == CONTENT and self.tools is not None:
                out.extend(self.tools.feed(piece.text))
            elif piece.text:
                out.append(piece)
        return out

    def feed(self, text: str) -> list[Part]:
        return self._route(self.think.feed(text) if self.think else [Piece(CONTENT, text)])

    def finish(self) -> list[Part]:
        out = self._route(self.think.finish() if self.think else [])
        if self.tools is not None:
            out.extend(self.tools.finish())
        return out


def reply_parser(
    fmt: ChatFormat, prompt: str, think: bool, tools: Sequence[Any] | None, prefill: str = ""
) -> Parser:
    """The parser for one request: thinking is split when it is on (from inside the block when
    the prompt opened it); with `think: false` a model that thinks anyway keeps its reasoning
    in the content, as Ollama does, rather than losing it. Tool calls are parsed when tools
    were sent."""
    if fmt.harmony:
        return HarmonyParser(tools)
    splitter = None
    if fmt.think is not None and think:
        call = "<tool_call>" if tools and fmt.tools == QWEN_XML else None
        splitter = ThinkSplitter(fmt.think, opens_thinking(prompt, fmt.think, prefill), call)
    parser = ToolCallParser(fmt.tools, tools) if tools and fmt.tools else None
    if splitter is None and parser is None:
        return Plain()
    return ReplyParser(splitter, parser)


@dataclass
class Reply:
    """A whole reply, gathered from its parts."""

    content: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, parts: list[Part]) -> None:
        for part in parts:
            if isinstance(part, ToolCall):
                self.calls.append(part)
            elif part.kind == THINKING:
                self.thinking.append(part.text)
            else:
                self.content.append(part.text)

    @classmethod
    def of(cls, parser: Parser, text: str) -> Reply:
        reply = cls()
        reply.add(parser.feed(text))
        reply.add(parser.finish())
        return reply
