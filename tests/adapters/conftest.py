"""Adapters trained once per session on the tiny target (and draft) with mlx-lm's tuner."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.adapters import train_adapter
from tests.fixtures.tiny_models import TinyPair


@dataclass(frozen=True)
class Adapters:
    sql: Path  # LoRA on every projection of the target
    tests: Path  # another LoRA, other text
    dora: Path  # DoRA on two projections, rank 2
    draft: Path  # a LoRA for the draft model
    other_base: Path  # a LoRA for the draft: it does not fit the target


@pytest.fixture(scope="session")
def adapters(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("adapters")
    sql = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2;"
    tests = "def test_add():\n    assert add(1, 2) == 3\n    assert add(2, 2) == 4\n"
    draft = train_adapter(tiny_pair.draft, root / "draft", sql, seed=3)
    return Adapters(
        sql=train_adapter(tiny_pair.target, root / "sql", sql, seed=1),
        tests=train_adapter(tiny_pair.target, root / "tests", tests, seed=2),
        dora=train_adapter(
            tiny_pair.target,
            root / "dora",
            tests,
            dora=True,
            rank=2,
            keys=["self_attn.q_proj", "self_attn.v_proj"],
        ),
        draft=draft,
        other_base=draft,
    )
