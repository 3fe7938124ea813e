"""The encoders against the numpy reference, in-process: every family, pooling, batching,
truncation, prefixes, dimensions and token-id inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxd.engine.backend import Backend, configure_backend
from mlxd.engine.embedding.model import (
    TOKENIZE_SLICE,
    Embedder,
    EmbeddingStopped,
    EmbedRequest,
    InputTooLong,
    load_embedder,
)
from mlxd.engine.embedding.runner import EmbeddingRunner, EmbedJob
from mlxd.engine.embedding.spec import spec_from_dir
from mlxd.registry.schema import ModelEntry
from tests.embed.conftest import POOLING, model_dirs
from tests.embed.reference import Reference
from tests.fixtures.tiny_embedders import TinyEmbedders, write_qwen3

TEXTS = (
    "Why is the sky blue?",
    "hello",
    "Llamas are members of the camelid family, and the quick brown fox jumps over the lazy dog.",
    "",
    "one two three",
)


@pytest.fixture(scope="module")
def loaded(embedders: TinyEmbedders) -> dict[str, Embedder]:
    backend = configure_backend()
    return {
        name: load_embedder(ModelEntry(name=name, target=str(path)), backend)
        for name, path in model_dirs(embedders).items()
    }


@pytest.mark.parametrize("name", list(POOLING))
def test_matches_the_numpy_reference(
    name: str, loaded: dict[str, Embedder], embedders: TinyEmbedders
) -> None:
    model = loaded[name]
    assert model.spec.pooling == POOLING[name]
    ref = Reference(model_dirs(embedders)[name], POOLING[name])
    out = model.embed(EmbedRequest(TEXTS))
    expected = np.stack([ref.embed(t) for t in TEXTS])
    np.testing.assert_allclose(out.vectors, expected, atol=2e-5)
    assert out.token_counts == tuple(len(ref.ids(t)) for t in TEXTS)
    np.testing.assert_allclose(np.linalg.norm(out.vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", list(POOLING))
def test_a_batch_equals_one_by_one(name: str, loaded: dict[str, Embedder]) -> None:
    model = loaded[name]
    batch = model.embed(EmbedRequest(TEXTS)).vectors
    alone = np.stack([model.embed(EmbedRequest((t,))).vectors[0] for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)
    again = model.embed(EmbedRequest((TEXTS[0], TEXTS[0]))).vectors
    assert float(again[0] @ again[1]) == pytest.approx(1.0, abs=1e-6)


def test_truncation_keeps_the_special_tokens(
    loaded: dict[str, Embedder], embedders: TinyEmbedders
) -> None:
    model = loaded["minilm"]
    long = " ".join(["sky"] * 200)
    with pytest.raises(InputTooLong, match="exceeds the context length"):
        model.embed(EmbedRequest((long,), truncate=False))
    out = model.embed(EmbedRequest((long,)))
    assert out.token_counts == (64,)
    ref = Reference(embedders.bert, "mean")
    ids = ref.ids(long)
    cut = [*ids[:63], ids[-1]]  # [CLS] ... [SEP]
    np.testing.assert_allclose(out.vectors[0], ref.embed_ids(cut), atol=2e-5)
    short = model.embed(EmbedRequest((long,), num_ctx=10))
    assert short.token_counts == (10,)


def test_many_inputs_are_cut_as_each_alone_and_stop_between_slices(
    loaded: dict[str, Embedder],
) -> None:
    """Thousands of inputs are tokenized (and the long ones cut) in slices, each input as it
    is alone; a stop between slices (the client left) ends the work."""
    model = loaded["minilm"]
    texts = tuple("sky " * (i % 90) + f"line {i}" for i in range(TOKENIZE_SLICE + 5))
    together = model.tokenize(EmbedRequest(texts))
    alone = [model.tokenize(EmbedRequest((t,)))[0] for t in texts[::37]]
    assert together[::37] == alone
    assert {len(ids) for ids in together} >= {64, 6}  # cut ones and short ones
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(EmbeddingStopped):
        model.tokenize(EmbedRequest(texts), stop)
    assert len(asked) == 2  # one slice done, then stopped


def test_decoder_truncation_ends_with_eos(
    loaded: dict[str, Embedder], embedders: TinyEmbedders
) -> None:
    model = loaded["qwen3-embedding"]
    out = model.embed(EmbedRequest(("the sky is blue " * 20,), num_ctx=16))
    assert out.token_counts == (16,)
    ref = Reference(embedders.qwen3, "last")
    ids = ref.ids("the sky is blue " * 20)
    np.testing.assert_allclose(out.vectors[0], ref.embed_ids([*ids[:15], 0]), atol=2e-5)


def test_prefixes_come_from_the_table(
    loaded: dict[str, Embedder], embedders: TinyEmbedders
) -> None:
    model = loaded["nomic"]
    ref = Reference(embedders.nomic, "mean")
    query = model.embed(EmbedRequest(("why is the sky blue",), prefix="query")).vectors[0]
    np.testing.assert_allclose(query, ref.embed("search_query: why is the sky blue"), atol=2e-5)
    doc = model.embed(EmbedRequest(("the sky",), prefix="document")).vectors[0]
    np.testing.assert_allclose(doc, ref.embed("search_document: the sky"), atol=2e-5)
    literal = model.embed(EmbedRequest(("the sky",), prefix="hello ")).vectors[0]
    np.testing.assert_allclose(literal, ref.embed("hello the sky"), atol=2e-5)
    assert loaded["bge"].spec.query_prefix == ""


def test_dimensions_slice_and_renormalise(loaded: dict[str, Embedder]) -> None:
    model = loaded["minilm"]
    full = model.embed(EmbedRequest(("hello world",))).vectors[0]
    cut = model.embed(EmbedRequest(("hello world",), dimensions=8)).vectors[0]
    np.testing.assert_allclose(cut, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    same = model.embed(EmbedRequest(("hello world",), dimensions=4096)).vectors[0]
    np.testing.assert_allclose(same, full, atol=1e-6)


def test_token_ids_are_embedded_as_given(
    loaded: dict[str, Embedder], embedders: TinyEmbedders
) -> None:
    model = loaded["bge"]
    ref = Reference(embedders.xlmr, "cls")
    ids = ref.ids("hello world")
    out = model.embed(EmbedRequest(("",), token_ids=(tuple(ids),)))
    np.testing.assert_allclose(out.vectors[0], ref.embed("hello world"), atol=2e-5)


def test_bare_transformer_names_load(
    tmp_path: Path, embedders: TinyEmbedders, backend: Backend
) -> None:
    """Qwen/Qwen3-Embedding's own files name tensors without `model.`."""
    bare = write_qwen3(
        tmp_path / "Qwen3-Embedding-bare", embedders.root / "bpe", seed=14, prefixed=False
    )
    model = load_embedder(ModelEntry(name="q", target=str(bare)), backend)
    ref = Reference(embedders.qwen3, "last")
    np.testing.assert_allclose(
        model.embed(EmbedRequest(("hello",))).vectors[0], ref.embed("hello"), atol=2e-5
    )


def test_batches_bound_padding_and_size() -> None:
    from mlxd.engine.embedding.model import MAX_BATCH, MAX_BATCH_TOKENS, MAX_PADDING, _batches

    lengths = sorted([70, 68, 66, 60, 52, 50, 40, 38, 12, 11, 10, *([5] * 100), 3000], reverse=True)
    batches = _batches(lengths)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        width, real = lengths[b.start], sum(lengths[i] for i in b)
        assert len(b) <= MAX_BATCH and len(b) * width <= max(width, MAX_BATCH_TOKENS)
        assert len(b) == 1 or len(b) * width <= (1 + MAX_PADDING) * real


def test_a_job_answered_before_its_forward_is_skipped(embedders: TinyEmbedders) -> None:
    """A job of a gathered forward that the daemon's stop answered before the runner took it
    is left as answered; the forward goes on for the others (the runner's thread died)."""
    entry = ModelEntry(name="minilm", target=str(embedders.bert))
    spec = spec_from_dir(entry, embedders.bert)
    assert spec is not None
    runner = EmbeddingRunner(entry, configure_backend(), spec)
    try:
        embedder = runner.loaded.result(60)
        answered, live = EmbedJob(EmbedRequest(("hi",))), EmbedJob(EmbedRequest(("hello",)))
        runner._current = [answered]  # gathered, not yet taken
        assert runner.end_requests(lambda: RuntimeError("stopping")) == 1
        runner._run([answered, live], embedder)
        assert isinstance(answered.future.exception(), RuntimeError)
        assert live.future.result().vectors.shape[0] == 1
    finally:
        runner._current = []
        runner.stop()
        assert runner.join(60)
