"""gpt-oss's harmony output split into reasoning, answer and tool calls.

The model writes messages: a header (`<|channel|>analysis`, maybe a recipient such as
`to=functions.get_weather`, maybe `<|constrain|>json`), `<|message|>`, a body, then `<|end|>`
(another message follows after `<|start|>assistant`), `<|call|>` or `<|return|>`. The analysis
channel is reasoning; a body addressed to `functions.NAME` is a call; the rest is the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from mlxd.api.thinking import CONTENT, THINKING, Piece, partial_tail
from mlxd.api.tools import ToolCall, call_id, parse_calls, tool_names

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyParser:
    def __init__(self, tools: Sequence[Any] | None) -> None:
        self.names = tool_names(tools)
        self._header = True
        self._held = ""
        self._kind = CONTENT
        self._recipient = ""
        self.count = 0

    def feed(self, text: str) -> list[Piece | ToolCall]:
        out: list[Piece | ToolCall] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._header:
                at = text.find(MESSAGE)
                if at < 0:
                    self._held = text
                    return out
                self._open(text[:at])
                text = text[at + len(MESSAGE) :]
                continue
            found = [(text.find(e), e) for e in ENDS if e in text]
            if not found:
                keep = max(partial_tail(text, e) for e in ENDS)
                body, self._held = text[: len(text) - keep], text[len(text) - keep :]
                if self._recipient:  # a call is given out whole, at its end
                    self._held = text
                elif body:
                    out.append(Piece(self._kind, body))
                return out
            at, end = min(found)
            out.extend(self._close(text[:at]))
            text = text[at + len(end) :]
        return out

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._header = False
        self._kind = THINKING if channel and channel.group(1) == "analysis" else CONTENT
        self._recipient = recipient.group(1) if recipient else ""

    def _close(self, body: str) -> list[Piece | ToolCall]:
        self._header = True
        recipient, self._recipient = self._recipient, ""
        if not recipient:
            return [Piece(self._kind, body)] if body else []
        name = recipient.removeprefix("functions.")
        calls = parse_calls(
            f'{{"name": {json.dumps(name)}, "arguments": {body or "{}"}}}', self.names
        )
        if not calls:
            return [Piece(CONTENT, body)]
        out: list[Piece | ToolCall] = []
        for fn, args in calls:
            out.append(ToolCall(fn, args, self.count, call_id()))
            self.count += 1
        return out

    def finish(self) -> list[Piece | ToolCall]:
        held, self._held = self._held, ""
        if self._header:
            return [Piece(CONTENT, held)] if held.strip() else []
        return self._close(held)
