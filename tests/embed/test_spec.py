"""Which registered models embed and how they pool: config detection, the table, the
sentence-transformers files and the registry's `kind` and `pooling` keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlxd.engine.embedding.spec import is_generative, spec_from_dir
from mlxd.registry.schema import ModelEntry, RegistryError, load_registry_file
from tests.fixtures.tiny_embedders import TinyEmbedders
from tests.fixtures.tiny_models import TinyPair


def entry(target: Path, name: str = "m", **fields: str) -> ModelEntry:
    return ModelEntry(name=name, target=str(target), **fields)  # type: ignore[arg-type]


def test_encoders_are_detected_from_their_config(embedders: TinyEmbedders) -> None:
    for path, family in (
        (embedders.bert, "bert"),
        (embedders.xlmr, "xlm-roberta"),
        (embedders.nomic, "nomic_bert"),
    ):
        spec = spec_from_dir(entry(path), path)
        assert spec is not None and spec.family == family


def test_pooling_from_the_table(embedders: TinyEmbedders) -> None:
    assert spec_from_dir(entry(embedders.xlmr), embedders.xlmr).pooling == "cls"  # type: ignore[union-attr]
    assert spec_from_dir(entry(embedders.bert), embedders.bert).pooling == "mean"  # type: ignore[union-attr]
    qwen = spec_from_dir(entry(embedders.qwen3), embedders.qwen3)
    assert qwen is not None and (qwen.family, qwen.pooling, qwen.append_eos) == (
        "decoder",
        "last",
        0,
    )
    assert qwen.query_prefix.startswith("Instruct: ")


def test_a_generative_model_is_not_an_embedding_model(tiny_pair: TinyPair, tmp_path: Path) -> None:
    assert spec_from_dir(entry(tiny_pair.target), tiny_pair.target) is None
    assert is_generative(entry(tiny_pair.target))
    forced = spec_from_dir(entry(tiny_pair.target, kind="embedding"), tiny_pair.target)
    assert forced is not None and (forced.family, forced.pooling) == ("decoder", "last")
    assert not is_generative(entry(tmp_path / "not-pulled"))


def test_kind_completion_and_pooling_override(embedders: TinyEmbedders) -> None:
    assert spec_from_dir(entry(embedders.bert, kind="completion"), embedders.bert) is None
    spec = spec_from_dir(entry(embedders.bert, pooling="cls"), embedders.bert)
    assert spec is not None and spec.pooling == "cls"


def test_sentence_transformers_files(embedders: TinyEmbedders, tmp_path: Path) -> None:
    model = tmp_path / "some-encoder"
    shutil.copytree(embedders.bert, model)
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (model / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    (model / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "q: ", "document": "d: "}})
    )
    spec = spec_from_dir(entry(model), model)
    assert spec is not None
    assert (spec.pooling, spec.max_length, spec.query_prefix, spec.document_prefix) == (
        "cls",
        32,
        "q: ",
        "d: ",
    )
    assert spec.prefix(None) == "" and spec.prefix("query") == "q: " and spec.prefix("x ") == "x "


def test_registry_keys(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  e:\n    target: org/e\n    kind: embedding\n    pooling: mean\n")
    e = load_registry_file(path)["e:latest"]
    assert (e.kind, e.pooling) == ("embedding", "mean")
    path.write_text("models:\n  e:\n    target: org/e\n    kind: embeddings\n")
    with pytest.raises(RegistryError, match="key 'kind': expected one of completion, embedding"):
        load_registry_file(path)
    path.write_text("models:\n  e:\n    target: org/e\n    pooling: max\n")
    with pytest.raises(RegistryError, match="key 'pooling'"):
        load_registry_file(path)
