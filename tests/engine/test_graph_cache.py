"""The engine raises MLX's CUDA graph cache before any GPU stream exists, unless the user set it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxd.engine import GRAPH_CACHE_SIZE

PROBE = "import engine, os; print(os.environ['MLX_CUDA_GRAPH_CACHE_SIZE'])"


@pytest.mark.parametrize(("given", "expected"), [(None, GRAPH_CACHE_SIZE), ("77", "77")])
def test_graph_cache_size_default_and_override(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLX_CUDA_GRAPH_CACHE_SIZE"}
    if given is not None:
        env["MLX_CUDA_GRAPH_CACHE_SIZE"] = given
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
    assert int(GRAPH_CACHE_SIZE) > 400  # MLX's own default
