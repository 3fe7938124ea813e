"""A token's own bytes: joined over a text's tokens they are the text, characters split
across tokens included (each part alone decodes to U+FFFD)."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.textstream import token_bytes
from tests.fixtures.tiny_models import TinyPair

TEXT = "def f():\n    return '中文 😀 naïve — ok'\n"


def test_joined_token_bytes_are_the_text(tiny_pair: TinyPair) -> None:
    tokenizer = load_tokenizer(tiny_pair.target)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    raw = token_bytes(tokenizer)
    assert b"".join(raw(t) for t in ids) == TEXT.encode()
    split = [t for t in ids if tokenizer.decode([t]) == "\ufffd"]
    assert split, "no character of the text is split across tokens: the test proves nothing"
    for t in ids:
        if "\ufffd" not in tokenizer.decode([t]):
            assert raw(t) == tokenizer.decode([t]).encode()


def test_a_tokenizer_of_another_kind_gives_its_decoded_text() -> None:
    class Plain:
        def decode(self, ids: list[int]) -> str:
            return "é" * len(ids)

    assert token_bytes(Plain())(5) == "é".encode()
