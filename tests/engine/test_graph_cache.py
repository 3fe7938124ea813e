"""Configuring the backend turns MLX's CUDA graphs off and sizes their cache and the attention
graphs' before any GPU work, unless the user set them; importing the engine alone sets
nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxd.engine.backend import (
    GRAPH_CACHE_ENV,
    GRAPH_CACHE_SIZE,
    GRAPHS_ENV,
    SDPA_CACHE_ENV,
    SDPA_CACHE_SIZE,
)


def configured(name: str) -> str:
    return (
        "from mlxd.engine.backend import configure_backend; configure_backend(); import os;"
        f" print(os.environ.get({name!r}))"
    )


def run(code: str, name: str, given: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != name}
    if given is not None:
        env[name] = given
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(("given", "expected"), [(None, str(GRAPH_CACHE_SIZE)), ("77", "77")])
def test_graph_cache_size_default_and_override(given: str | None, expected: str) -> None:
    assert run(configured(GRAPH_CACHE_ENV), GRAPH_CACHE_ENV, given) == expected
    assert GRAPH_CACHE_SIZE > 400  # MLX's own default


@pytest.mark.parametrize(("given", "expected"), [(None, str(SDPA_CACHE_SIZE)), ("77", "77")])
def test_attention_graph_cache_size_default_and_override(given: str | None, expected: str) -> None:
    assert run(configured(SDPA_CACHE_ENV), SDPA_CACHE_ENV, given) == expected
    assert SDPA_CACHE_SIZE > 256  # MLX's own default


@pytest.mark.parametrize(("given", "expected"), [(None, "0"), ("1", "1")])
def test_cuda_graphs_are_off_unless_the_user_turns_them_on(
    given: str | None, expected: str
) -> None:
    assert run(configured(GRAPHS_ENV), GRAPHS_ENV, given) == expected


@pytest.mark.parametrize("name", [GRAPH_CACHE_ENV, GRAPHS_ENV, SDPA_CACHE_ENV])
def test_importing_the_engine_leaves_the_graph_settings_alone(name: str) -> None:
    code = f"import mlxd.engine.manager, os; print(os.environ.get({name!r}))"
    assert run(code, name, None) == "None"
