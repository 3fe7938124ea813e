"""`mlxd pull` of an embedding repo in sentence-transformers layout: the pooling config in its
subfolder comes down with the weights, ONNX exports do not, and the pulled model embeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import ollama

from mlxd.registry.store import resolve_local
from tests.conftest import RunningServer
from tests.embed.reference import Reference
from tests.fixtures.tiny_embedders import build_embedders
from tests.pull.conftest import HubEnv, cli


def test_pull_an_embedding_repo(mlxd: RunningServer, hub_env: HubEnv, tmp_path: Path) -> None:
    source = tmp_path / "encoder"
    shutil.copytree(build_embedders(tmp_path / "built").bert, source)
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": True})
    )
    (source / "modules.json").write_text("[]")
    (source / "onnx").mkdir()
    (source / "onnx" / "model.onnx").write_bytes(b"\0" * 1024)
    hub_env.hub.add_repo("org/encoder", source)

    result = cli(["pull", "org/encoder"], mlxd)
    assert result.returncode == 0, result.stderr
    local = resolve_local("org/encoder")
    assert local is not None
    assert (local / "1_Pooling" / "config.json").is_file()
    assert not (local / "onnx").exists()

    client = ollama.Client(host=mlxd.base_url)
    assert client.show("hf.co/org/encoder").capabilities == ["embedding"]
    out = client.embed(model="hf.co/org/encoder", input=["hello world", "why is the sky blue"])
    ref = Reference(source, "cls")  # the pooling its 1_Pooling/config.json names
    expected = np.stack([ref.embed("hello world"), ref.embed("why is the sky blue")])
    np.testing.assert_allclose(np.array(out.embeddings), expected, atol=5e-5)
