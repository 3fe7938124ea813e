"""Engine fixtures: the tiny pair loaded once through mlx-lm, as the server loads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm import load

from tests.fixtures.tiny_models import TinyPair


@dataclass
class Loaded:
    target: nn.Module
    draft: nn.Module
    tokenizer: Any


@pytest.fixture(scope="session")
def loaded(tiny_pair: TinyPair) -> Loaded:
    target, tokenizer = load(str(tiny_pair.target))[:2]
    draft = load(str(tiny_pair.draft))[0]
    return Loaded(target, draft, tokenizer)
