"""Reasoning split out of a model's streamed text: `<think>...</think>`-style tags, including
templates that open the block in the prompt, so the output starts inside it.

Text arrives in arbitrary pieces (a tag may be split across tokens); a tail that could still
become a tag is held back until the next piece says what it is, so a client never sees part
of a tag as content.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.api.chatformat import ThinkTags

CONTENT = "content"
THINKING = "thinking"


@dataclass(frozen=True)
class Piece:
    """A run of output text and where it goes: the answer or the reasoning."""

    kind: str  # CONTENT | THINKING
    text: str


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """Routes text between the tags to THINKING and the rest to CONTENT.

    Only a think block at the start of the output is reasoning (as Ollama's parser): once
    content has started, a later `<think>` is content. Whitespace around the tags is dropped,
    as the templates put newlines there. `call`: a call's opening that ends the reasoning
    without its close (Qwen3.5 writes `<tool_call>` then `<function=` before `</think>`); it
    goes on as content, for the tool parser.
    """

    CALL_BODY = "<function="  # what follows `call` where it ends the reasoning

    def __init__(self, tags: ThinkTags, inside: bool = False, call: str | None = None) -> None:
        self.tags = tags
        self.call = call
        self._state = "thinking" if inside else "start"  # start | thinking | content
        self._held = ""
        self._strip = inside  # drop whitespace at the next text

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._strip:
                text = text.lstrip()
                if not text:
                    return out
                self._strip = False
            if self._state == "content":
                out.append(Piece(CONTENT, text))
                return out
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped or (
                    len(stripped) < len(self.tags.open) and self.tags.open.startswith(stripped)
                ):
                    self._held = text  # leading space, or the start of the opening tag
                    return out
                if stripped.startswith(self.tags.open):
                    self._state, self._strip = "thinking", True
                    text = stripped[len(self.tags.open) :]
                    continue
                self._state = "content"
                continue
            # thinking
            at = text.find(self.tags.close)
            call = self._call_at(text, at)
            if call is not None:
                if call < 0:  # a call's opening, not yet followed far enough to tell
                    body = text[: -call - 1].rstrip()
                    if body:
                        out.append(Piece(THINKING, body))
                    self._held = text[len(body) :]
                    return out
                if text[:call].rstrip():
                    out.append(Piece(THINKING, text[:call].rstrip()))
                self._state = "content"
                text = text[call:]
                continue
            if at >= 0:
                if text[:at].rstrip():
                    out.append(Piece(THINKING, text[:at].rstrip()))
                self._state, self._strip = "content", True
                text = text[at + len(self.tags.close) :]
                continue
            # hold a possible start of the closing tag (or a call's), and whitespace before it
            keep = partial_tail(text, self.tags.close)
            if self.call is not None:
                keep = max(keep, partial_tail(text, self.call))
            body = text[: len(text) - keep]
            body = body.rstrip()
            if body:
                out.append(Piece(THINKING, body))
            self._held = text[len(body) :]
            return out
        return out

    def _call_at(self, text: str, close: int) -> int | None:
        """Where a call opens the text before the close (`close`, -1: none yet): its index; or
        -(index + 1) where what follows it cannot tell yet; None where no call opens."""
        if self.call is None:
            return None
        start = 0
        while (at := text.find(self.call, start)) >= 0 and (close < 0 or at < close):
            after = text[at + len(self.call) :].lstrip()
            if after.startswith(self.CALL_BODY):
                return at
            if self.CALL_BODY.startswith(after):
                return -(at + 1)
            start = at + len(self.call)
        return None

    def finish(self) -> list[Piece]:
        """Held text at the end: a reasoning that never closed stays reasoning."""
        held, self._held = self._held, ""
        if not held or (self._strip and not held.strip()):
            return []
        kind = THINKING if self._state == "thinking" else CONTENT
        return [Piece(kind, held)]
