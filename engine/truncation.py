"""Fitting a prompt longer than its row's context, as Ollama does instead of refusing it: keep
the head (the system prompt and the template's opening) and the most recent tokens, drop the
middle, and leave room to answer.

Tokens are cut, never text, so a special token is kept whole or dropped whole: none becomes
plain text. A text far longer than the context is only tokenized near its ends (a token spans at
most `chars_per_token` characters, the longest of the tokenizer's vocabulary, so a window of
`context × that` characters holds more tokens than the prompt keeps; the token cut at the
window's edge is always among the dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHARS_PER_TOKEN = 64  # a bound for a tokenizer whose vocabulary cannot be read


@dataclass(frozen=True)
class Budget:
    """How many tokens a prompt may keep of a row of `context` tokens."""

    context: int
    reserve: int  # tokens left to the answer when the prompt must be cut
    chars_per_token: int = MAX_CHARS_PER_TOKEN  # the longest token, in characters

    @classmethod
    def of(
        cls, context: int, num_predict: int, chars_per_token: int = MAX_CHARS_PER_TOKEN
    ) -> Budget:
        """Room for `num_predict` tokens (a quarter of the context when unbounded), never more
        than half the context, never less than one token."""
        wanted = num_predict if num_predict > 0 else context // 4
        return cls(context, max(1, min(wanted, context // 2)), max(1, chars_per_token))

    @property
    def prompt(self) -> int:
        return max(1, self.context - self.reserve)

    @property
    def window(self) -> int:
        """Characters of a text's tail that hold more tokens than a prompt keeps."""
        return (self.context + 1) * self.chars_per_token


def fit(head: list[int], body: list[int], limit: int) -> list[int]:
    """`head + body` in at most `limit` tokens: the head (at most half of them, unless the body
    needs less) and the end of the body."""
    if len(head) + len(body) <= limit:
        return head + body
    head = head[: max(limit // 2, limit - len(body))]
    keep = limit - len(head)
    return head + body[len(body) - keep :]
