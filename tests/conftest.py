"""Shared pytest fixtures for the mlxd test suite."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_models import TinyPair, build_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """Build the tiny target/draft pair once per session; building takes well under 1 s."""
    return build_pair(tmp_path_factory.mktemp("models"))
