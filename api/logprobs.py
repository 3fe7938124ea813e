"""`logprobs` / `top_logprobs` on the wire: the request's ask, checked, and the engine's values
in Ollama's shape (/api) and OpenAI's (/v1 chat and completions)."""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Sequence
from typing import Any

from mlxd.api.errors import ApiError
from mlxd.engine.logprobs import MAX_TOP_LOGPROBS, Logprob
from mlxd.engine.options import SamplingOptions


def asked(logprobs: bool | None, top: int | None) -> int | None:
    """How many alternatives per token the request wants; None: no log-probabilities.
    `top_logprobs` above 0 implies `logprobs`."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if logprobs or (top or 0) > 0:
        return top or 0
    return None


def with_logprobs(opts: SamplingOptions, top: int | None) -> SamplingOptions:
    return opts if top is None else dataclasses.replace(opts, top_logprobs=top)


def _one(p: Logprob) -> dict[str, Any]:
    return {"token": p.token, "logprob": p.logprob, "bytes": list(p.bytes)}


def ollama_json(entries: Sequence[Logprob]) -> list[dict[str, Any]] | None:
    """Ollama's `logprobs`: one object per token; `top_logprobs` only when asked for."""
    if not entries:
        return None
    out = []
    for p in entries:
        obj = _one(p)
        if p.top:
            obj["top_logprobs"] = [_one(t) for t in p.top]
        out.append(obj)
    return out


def openai_chat_json(entries: Sequence[Logprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: `{"content": [...]}`, `top_logprobs` always a list."""
    return {"content": [{**_one(p), "top_logprobs": [_one(t) for t in p.top]} for p in entries]}


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters: those its tokens'
    own bytes decode to before it. A token that continues a character shares that character's
    offset; one pass over a response's tokens, whether they go out whole or in pieces. A
    SentencePiece reply's text drops its first token's space (`▁Hello` opens it as "Hello"):
    the spaces the text does not start with are not counted."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0
        self._dropped: int | None = None  # leading spaces the text leaves out (known once seen)

    def take(self, entries: Sequence[Logprob], text: str) -> list[int]:
        """Offsets of `entries`, which carry `text` (the next part of the choice's text)."""
        out = []
        for p in entries:
            out.append(max(0, self._chars - (self._dropped or 0)))
            piece = self._decoder.decode(bytes(p.bytes))
            if self._dropped is None and piece:
                spaces = len(piece) - len(piece.lstrip(" "))
                self._dropped = max(0, spaces - (len(text) - len(text.lstrip(" "))))
            self._chars += len(piece)
        return out


def _by_text(top: Sequence[Logprob]) -> dict[str, float]:
    """Alternatives keyed by their text, most likely first. A token that is a piece of a
    character (its text reads U+FFFD) is keyed by its bytes, as OpenAI writes them
    (`bytes:\\xe6\\x97`): pieces of different characters no longer overwrite one another;
    tokens that still read alike keep the likeliest's value."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(_text_key(t), t.logprob)
    return out


def _text_key(t: Logprob) -> str:
    try:
        bytes(t.bytes).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in t.bytes)
    return t.token


def openai_completion_json(
    entries: Sequence[Logprob], offsets: TextOffsets, text: str
) -> dict[str, Any]:
    """A text choice's legacy `logprobs`: parallel lists, `text_offset` from `offsets` (the
    entries carry `text`)."""
    return {
        "tokens": [_text_key(p) for p in entries],
        "token_logprobs": [p.logprob for p in entries],
        "top_logprobs": [_by_text(p.top) for p in entries],
        "text_offset": offsets.take(entries, text),
    }
