"""Tokens to streamed text: UTF-8 safe incremental decoding and stop strings held back.

The detokenizer decodes a short window of recent tokens and emits only the new suffix, waiting
while the window ends inside a multi-byte character (the decoder's U+FFFD). The stop matcher
holds back any tail that could still become a stop string, so a client never sees part of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Works for any tokenizer with a `decode(ids) -> str` (byte-level BPE, SentencePiece)."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix = 0  # window start: decoding from here gives stable leading text
        self._read = 0  # tokens before this index have been emitted

    def add(self, token: int) -> str:
        self._tokens.append(token)
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        new = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._tokens)
        return new

    def flush(self) -> str:
        """Whatever is left at the end, replacement characters included."""
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Feeds text through, returning what is safe to emit and whether a stop string was hit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self._held + text
        if not self.stops:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._holdback(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation, held text that never became a stop string is emitted."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
