"""An embedding model loaded for serving: its tokenizer, its network and its spec, and the one
call that turns texts into unit vectors in padded batches."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer

from mlxd.engine.backend import Backend
from mlxd.engine.embedding.bert import BertModel
from mlxd.engine.embedding.decoder import DecoderModel
from mlxd.engine.embedding.nomic import NomicBertModel
from mlxd.engine.embedding.pooling import normalize, pool, truncate_dimensions
from mlxd.engine.embedding.spec import EmbeddingSpec, embedding_spec
from mlxd.engine.memory import computes_in_float32
from mlxd.engine.pairing import ModelUnavailable, locate, revision_of
from mlxd.engine.progress import beat
from mlxd.registry.schema import ModelEntry

MAX_BATCH = 64  # inputs per forward
MAX_BATCH_TOKENS = 8192  # padded tokens per forward: bounds its memory and its time
MAX_PADDING = 0.25  # pads per real token a batch may carry before the next one starts
TOKENIZE_SLICE = 1024  # inputs tokenized between checks that someone still waits


def _batches(lengths: Sequence[int]) -> list[range]:
    """Consecutive batches of `lengths` (sorted longest first) for padded forwards."""
    out: list[range] = []
    start = 0
    while start < len(lengths):
        width = max(1, lengths[start])
        end, real = start + 1, lengths[start]
        while end < len(lengths) and end - start < MAX_BATCH:
            count = end - start + 1
            if count * width > MAX_BATCH_TOKENS:
                break
            if count * width > (1 + MAX_PADDING) * (real + lengths[end]):
                break
            real += lengths[end]
            end += 1
        out.append(range(start, end))
        start = end
    return out


class InputTooLong(ValueError):
    """An input is longer than the model's context and truncation was turned off (400)."""

    def __init__(self) -> None:
        super().__init__("the input length exceeds the context length")


class EmptyInput(ValueError):
    """An input has no tokens at all, or ids outside the vocabulary (400)."""


class NotAnEmbeddingModel(ModelUnavailable):
    """Embeddings were asked of a generative model (Ollama answers 501)."""

    def __init__(self) -> None:
        super().__init__("this model does not support embeddings")


@dataclass(frozen=True)
class EmbedRequest:
    """One request's texts and how to embed them, parsed at the edge."""

    texts: tuple[str, ...]
    truncate: bool = True
    dimensions: int | None = None
    num_ctx: int | None = None  # options.num_ctx: a tighter context than the model's
    prefix: str | None = None  # "query", "document" or literal text (`EmbeddingSpec.prefix`)
    token_ids: tuple[tuple[int, ...], ...] | None = None  # the model's ids, instead of texts


@dataclass(frozen=True)
class Embedded:
    """Unit vectors, one row per input in request order, and the tokens they took."""

    vectors: np.ndarray  # (n, d) float32
    token_counts: tuple[int, ...]
    seconds: float  # tokenizing and forwards, on the runner's thread

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


def _network(spec: EmbeddingSpec, config: dict[str, Any]) -> nn.Module:
    if spec.family == "bert":
        return BertModel(config)
    if spec.family == "xlm-roberta":
        return BertModel(config, roberta=True)
    if spec.family == "nomic_bert":
        return NomicBertModel(config)
    return DecoderModel(config)


def _tokenizer(path: Path) -> Tokenizer:
    """The fast tokenizer: `tokenizer.json`, else whatever transformers builds from the files
    (a `vocab.txt`, a sentencepiece model) without the network."""
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    from transformers import AutoTokenizer

    backend: Tokenizer = AutoTokenizer.from_pretrained(str(path)).backend_tokenizer
    return backend


def _weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelUnavailable(f"no safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    return weights


class Embedder:
    """A loaded embedding model (owned by one runner thread)."""

    def __init__(
        self, entry: ModelEntry, spec: EmbeddingSpec, path: Path, backend: Backend
    ) -> None:
        self.entry = entry
        self.spec = spec
        self.path = path
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        self.config = config
        self.network = _network(spec, config)
        weights = self.network.sanitize(_weights(path))
        quant = config.get("quantization")
        if isinstance(quant, dict):
            nn.quantize(
                self.network,
                group_size=quant.get("group_size", 64),
                bits=quant.get("bits", 4),
                mode=quant.get("mode", "affine"),
                class_predicate=lambda p, m: f"{p}.scales" in weights,
            )
        self.network.load_weights(list(weights.items()), strict=True)
        if computes_in_float32(config, backend.float32_compute, backend.quantized_float32):
            self.network.set_dtype(mx.float32)
        self.network.eval()
        mx.eval(self.network.parameters())
        self.tokenizer = _tokenizer(path)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        pad = config.get("pad_token_id")
        self.pad_id = pad if isinstance(pad, int) and not isinstance(pad, bool) else 0
        self.revision = revision_of(path, config, backend)

    # -- tokens --------------------------------------------------------------------------------

    def limit(self, num_ctx: int | None) -> int:
        """Tokens per input: the model's, or less when the request's num_ctx says so."""
        return self.spec.limit(num_ctx)

    def _finish(self, ids: list[int]) -> list[int]:
        eos = self.spec.append_eos
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        return ids

    def tokenize(
        self, request: EmbedRequest, stop: Callable[[], bool] = lambda: False
    ) -> list[list[int]]:
        """Each input's ids (prefix applied), cut to the limit unless `truncate` is off.
        `stop()` true between slices of `TOKENIZE_SLICE` inputs ends it with EmbeddingStopped:
        thousands of long inputs take seconds to tokenize for a client that may have left."""
        limit = self.limit(request.num_ctx)
        if request.token_ids is not None:
            return [self._given(ids, limit, request.truncate) for ids in request.token_ids]
        prefix = self.spec.prefix(request.prefix)
        texts = [prefix + text for text in request.texts]
        out = [self._finish(ids) for ids in self._encode(texts, stop)]
        long: list[int] = []
        for i, ids in enumerate(out):
            if not ids:
                raise EmptyInput(f"input at index {i} has no tokens")
            if len(ids) > limit:
                if not request.truncate:
                    raise InputTooLong()
                long.append(i)
        if long:
            cut = self._cut([texts[i] for i in long], limit, stop)
            for i, ids in zip(long, cut, strict=True):
                out[i] = ids
        return out

    def _encode(self, texts: Sequence[str], stop: Callable[[], bool]) -> list[list[int]]:
        """`encode_batch` a slice at a time (it lets go of the GIL; `encode` held it for
        seconds on a long text)."""
        out: list[list[int]] = []
        for start in range(0, len(texts), TOKENIZE_SLICE):
            if stop():
                raise EmbeddingStopped()
            batch = self.tokenizer.encode_batch(list(texts[start : start + TOKENIZE_SLICE]))
            out += [list(e.ids) for e in batch]
        return out

    def _given(self, ids: tuple[int, ...], limit: int, truncate: bool) -> list[int]:
        """Token ids a client sent (OpenAI's token-array input): in range, and within the
        limit (cut from the end) unless truncation is off."""
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if not ids:
            raise EmptyInput("an input has no tokens")
        if any(t < 0 or t >= vocab for t in ids):
            raise EmptyInput(f"token id out of range (the vocabulary has {vocab} tokens)")
        if len(ids) > limit and not truncate:
            raise InputTooLong()
        return list(ids[:limit])

    def _cut(self, texts: Sequence[str], limit: int, stop: Callable[[], bool]) -> list[list[int]]:
        """`texts`' ids within `limit`, the special tokens kept (the tokenizer's truncation
        makes room for them; a decoder's end token is put back last)."""
        room = limit - (1 if self.spec.append_eos is not None else 0)
        self.tokenizer.enable_truncation(max_length=max(1, room))
        try:
            return [self._finish(ids)[:limit] for ids in self._encode(texts, stop)]
        finally:
            self.tokenizer.no_truncation()

    # -- forwards ------------------------------------------------------------------------------

    def forward(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """One padded forward of `batch`: its pooled vectors, (len(batch), d) float32."""
        width = max(len(ids) for ids in batch)
        padded = np.full((len(batch), width), self.pad_id, dtype=np.int32)
        for row, ids in enumerate(batch):
            padded[row, : len(ids)] = ids
        lengths = mx.array([len(ids) for ids in batch])
        mask = mx.arange(width)[None, :] < lengths[:, None]
        hidden = self.network(mx.array(padded), mask)
        pooled = pool(hidden, mask, lengths, self.spec.pooling).astype(mx.float32)
        mx.eval(pooled)
        return np.array(pooled)

    def vectors(
        self, inputs: Sequence[Sequence[int]], stop: Callable[[], bool] = lambda: False
    ) -> np.ndarray:
        """Unit vectors of every input in order. Inputs are sorted by length and cut into
        padded batches of `MAX_BATCH` inputs or `MAX_BATCH_TOKENS` at most, a batch ending
        where padding would pass `MAX_PADDING` of its tokens (on the CPU a pad costs what a
        token does); each forward done is progress for the runner's watchdog. `stop()` true
        before a batch (nobody waits for the vectors any more) ends it with EmbeddingStopped."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]), reverse=True)
        out: np.ndarray | None = None
        for chunk in _batches([len(inputs[i]) for i in order]):
            if stop():
                raise EmbeddingStopped()
            rows = [order[i] for i in chunk]
            pooled = self.forward([inputs[i] for i in rows])
            if out is None:
                out = np.zeros((len(inputs), pooled.shape[-1]), dtype=np.float32)
            out[rows] = pooled
            beat()
        return normalize(out) if out is not None else np.zeros((0, 0), dtype=np.float32)

    def embed(self, request: EmbedRequest) -> Embedded:
        t0 = time.perf_counter()
        ids = self.tokenize(request)
        vectors = truncate_dimensions(self.vectors(ids), request.dimensions)
        return Embedded(vectors, tuple(len(i) for i in ids), time.perf_counter() - t0)


class EmbeddingStopped(RuntimeError):
    """A forward ended before its last batch: every request waiting for it went away."""


def load_embedder(entry: ModelEntry, backend: Backend) -> Embedder:
    """Open `entry`'s embedding model (ModelUnavailable when it is not one, or is broken)."""
    path = locate(entry.target, "model")
    spec = embedding_spec(entry)
    if spec is None:
        raise NotAnEmbeddingModel()
    try:
        embedder = Embedder(entry, spec, path, backend)
        embedder.vectors([[embedder.pad_id, embedder.pad_id]])  # proves the forward runs
    except ModelUnavailable:
        raise
    except Exception as exc:
        raise ModelUnavailable(f"cannot load {path}: {exc}") from exc
    return embedder
