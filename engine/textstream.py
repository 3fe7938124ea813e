"""Tokens to streamed text: UTF-8 safe incremental decoding and stop strings held back.

The detokenizer decodes a short window of recent tokens and emits only the new suffix, waiting
while the window ends inside a multi-byte character (the decoder's U+FFFD). The stop matcher
holds back any tail that could still become a stop string, so a client never sees part of one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[Sequence[int]], str]
TokenBytes = Callable[[int], bytes]

SPM_SPACE = "\u2581".encode()


def token_bytes(tokenizer: Any) -> TokenBytes:
    """Each token's own bytes, what it adds to the text: a token that is part of a character
    gives that part (decoding it alone gives U+FFFD). Read from the vocabulary mlx-lm's
    streaming detokenizer holds (byte-level BPE: its byte alphabet; SentencePiece: `<0xNN>`
    byte tokens and `▁` spaces); a tokenizer of another kind gives its decoded text's bytes."""
    held = getattr(tokenizer, "_detokenizer", None)
    table = getattr(held, "tokenmap", None)
    decode: Decode = tokenizer.decode

    def text_bytes(token: int) -> bytes:
        return decode([token]).encode("utf-8", "surrogatepass")

    if not isinstance(table, list) or not table:
        return _spm_pieces(tokenizer) or text_bytes
    if isinstance(table[0], bytes):  # SentencePiece: bytes already, `▁` for a space
        return lambda t: table[t].replace(SPM_SPACE, b" ") if t < len(table) else text_bytes(t)
    alphabet = _byte_alphabet()

    def bpe(token: int) -> bytes:
        if token >= len(table):
            return text_bytes(token)
        piece = table[token]
        return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode("utf-8") for c in piece)

    return bpe


def _spm_pieces(tokenizer: Any) -> TokenBytes | None:
    """A SentencePiece vocabulary's bytes where mlx-lm holds no table for it (a model shipping
    only `tokenizer.model`): read from its pieces, `<0xNN>` a byte and `▁` a space; None for a
    vocabulary of another kind."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    vocab = getattr(tokenizer, "vocab", None)
    if convert is None or not isinstance(vocab, dict) or "<0x0A>" not in vocab:
        return None
    if not any(piece.startswith("\u2581") for piece in vocab):
        return None
    decode: Decode = tokenizer.decode

    def piece_bytes(token: int) -> bytes:
        piece = convert(token)
        if not isinstance(piece, str):
            return decode([token]).encode("utf-8", "surrogatepass")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8", "surrogatepass")

    return piece_bytes


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: a printable character for each of the 256 bytes (GPT-2's
    `bytes_to_unicode`), back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    shifted = [b for b in range(256) if b not in printable]
    out = {chr(b): b for b in printable}
    out.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return out


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
