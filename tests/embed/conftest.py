"""Tiny embedding models, and one server whose registry serves them next to a generative one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningServer, ServerThread
from tests.fixtures.tiny_embedders import TinyEmbedders, build_embedders
from tests.fixtures.tiny_models import TinyPair

# litellm fetches a model cost map from the network at import unless told to use its own copy.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

POOLING = {"minilm": "mean", "bge": "cls", "nomic": "mean", "qwen3-embedding": "last"}


@pytest.fixture(scope="session")
def embedders(tmp_path_factory: pytest.TempPathFactory) -> TinyEmbedders:
    return build_embedders(tmp_path_factory.mktemp("embedders"))


def model_dirs(e: TinyEmbedders) -> dict[str, Path]:
    return {"minilm": e.bert, "bge": e.xlmr, "nomic": e.nomic, "qwen3-embedding": e.qwen3}


@pytest.fixture(scope="session")
def embed_registry(
    embedders: TinyEmbedders, tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("embed-registry") / "models.yaml"
    lines = ["models:"]
    for name, target in model_dirs(embedders).items():
        lines.append(f"  {name}:\n    target: {target}")
    # a neutral name, so only `kind` and `pooling` say what it is
    lines.append(
        f"  plain-encoder:\n    target: {embedders.bert}\n    kind: embedding\n    pooling: cls"
    )
    lines.append(f"  tiny:\n    target: {tiny_pair.target}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def embed_server(embed_registry: Path) -> Iterator[RunningServer]:
    with ServerThread(embed_registry) as info:
        yield info
