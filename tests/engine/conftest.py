"""Engine fixtures: the tiny pair loaded once through mlx-lm, as the server loads it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm import load

from mlxd.engine.backend import Backend, configure_backend
from mlxd.engine.kvcache import set_bucket
from mlxd.engine.pairing import Pairing, load_pairing
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from tests.fixtures.scripted_models import Script, build_scripted
from tests.fixtures.tiny_models import TinyPair

GPU_TEST_BUCKET = 256  # the GPU's layout with smaller buckets: tiny models, short prompts
FLAT = Costs(verify={w: 1.0 for w in range(1, 40)}, draft_step=0.01)  # every width costs alike
PIECES = tuple(f"w{i:02d}" for i in range(40))  # what the copier writes after "@"


@dataclass
class Loaded:
    target: nn.Module
    draft: nn.Module
    tokenizer: Any


@pytest.fixture(scope="session")
def loaded(tiny_pair: TinyPair) -> Loaded:
    target, tokenizer = load(str(tiny_pair.target))[:2]
    draft = load(str(tiny_pair.draft))[0]
    pair = Loaded(target, draft, tokenizer)
    lay_out(pair, configure_backend())
    return pair


def lay_out(pair: Loaded, backend: Backend) -> None:
    """Give the models' caches the layout `backend` chooses, as `load_pairing` does."""
    for model in (pair.target, pair.draft):
        set_bucket(model, backend.kv_bucket)


@pytest.fixture
def gpu_layout(loaded: Loaded) -> Iterator[Backend]:
    """Run with the GPU's cache layout (bucketed KV buffers, power-of-two prefill) on the CPU:
    the backend pairings load with (the `backend` fixture) and the `loaded` models take it."""
    bucketed = replace(configure_backend(), kv_bucket=GPU_TEST_BUCKET)
    lay_out(loaded, bucketed)
    try:
        yield bucketed
    finally:
        lay_out(loaded, configure_backend())


@pytest.fixture(scope="module")
def copier(tmp_path_factory: pytest.TempPathFactory) -> Pairing:
    """A model that writes PIECES after "@" and nothing else (no draft model): a bigram machine
    over them, each piece followed by the next."""
    path = build_scripted(tmp_path_factory.mktemp("copier"), "generic", Script("@", PIECES))
    return load_pairing(ModelEntry("copier", str(path)), configure_backend(), costs=FLAT)


def backend_says(name: str, value: str | None, printed: str) -> list[bool]:
    """What a fresh process's `configure_backend()` (as `b`) gives with env `name` set to
    `value` (None: unset): the words of `printed`, a print of Python booleans, as booleans."""
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    code = f"from mlxd.engine.backend import configure_backend; b = configure_backend(); {printed}"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return [word == "True" for word in out.stdout.split()]
