"""Configuring the backend sizes MLX's CUDA graph cache before any GPU stream exists, unless
the user set it; importing the engine alone sets nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxd.engine.backend import GRAPH_CACHE_ENV, GRAPH_CACHE_SIZE

CONFIGURED = (
    "from mlxd.engine.backend import configure_backend; configure_backend(); import os;"
    f" print(os.environ.get({GRAPH_CACHE_ENV!r}))"
)
IMPORTED = f"import mlxd.engine.manager, os; print(os.environ.get({GRAPH_CACHE_ENV!r}))"


def run(code: str, given: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != GRAPH_CACHE_ENV}
    if given is not None:
        env[GRAPH_CACHE_ENV] = given
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(("given", "expected"), [(None, str(GRAPH_CACHE_SIZE)), ("77", "77")])
def test_graph_cache_size_default_and_override(given: str | None, expected: str) -> None:
    assert run(CONFIGURED, given) == expected
    assert GRAPH_CACHE_SIZE > 400  # MLX's own default


def test_importing_the_engine_leaves_the_graph_cache_alone() -> None:
    assert run(IMPORTED, None) == "None"
