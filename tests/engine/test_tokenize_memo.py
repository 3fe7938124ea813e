"""Long prompts sent again are not tokenized again, and get exactly the tokens they would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine import prompt
from mlxd.engine.prompt import MEMO_ENTRIES, MEMO_MIN_CHARS, encode

CODE_PAIR = Path(__file__).resolve().parents[3] / "shared" / "models" / "code-pair" / "target"
TEXT = Path(prompt.__file__).read_text(encoding="utf-8")


class Counting:
    """A real tokenizer that counts its encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def test_a_long_text_is_tokenized_once_with_the_same_tokens() -> None:
    tok = Counting(load_tokenizer(CODE_PAIR))
    text = TEXT[: 3 * MEMO_MIN_CHARS]
    want = list(tok.tokenizer.encode(text, add_special_tokens=True))
    first = encode(tok, text, specials=True)
    first.append(-1)  # a caller's edits never reach the memo
    assert encode(tok, text, specials=True) == want
    assert tok.calls == 1
    bare = encode(tok, text, specials=False)  # special tokens differ: its own entry
    assert bare == list(tok.tokenizer.encode(text, add_special_tokens=False))
    assert tok.calls == 2


def test_short_texts_are_not_kept_and_long_ones_are_bounded() -> None:
    tok = Counting(load_tokenizer(CODE_PAIR))
    short = TEXT[: MEMO_MIN_CHARS - 1]
    encode(tok, short, False)
    encode(tok, short, False)
    assert tok.calls == 2
    texts = [f"# {i}\n" + TEXT[:MEMO_MIN_CHARS] for i in range(MEMO_ENTRIES + 1)]
    for text in texts:
        encode(tok, text, False)
    calls = tok.calls
    encode(tok, texts[-1], False)  # recent: remembered
    assert tok.calls == calls
    encode(tok, texts[0], False)  # the oldest went
    assert tok.calls == calls + 1
