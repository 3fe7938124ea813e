"""Whether a registered model embeds, and how: read from its files and the table, never by
loading it (pure Python: the API asks this for /api/show without touching mlx).

A model embeds when its registry entry says `kind: embedding`, when its config names an encoder
architecture (BERT, XLM-RoBERTa, NomicBERT), or when it is a decoder that the table or its
sentence-transformers files mark as an embedding model (Qwen3-Embedding). `kind: completion`
forces the generative path.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.engine.embedding.table import CLS, LAST, MEAN, POOLINGS, KnownModel, known_model
from mlxd.engine.options import OptionsError, parse_options
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import resolve_local

# model_type -> the encoder family that computes it
ENCODER_TYPES = {
    "bert": "bert",
    "xlm-roberta": "xlm-roberta",
    "roberta": "xlm-roberta",
    "nomic_bert": "nomic_bert",
}
ENCODER_ARCHITECTURES = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "XLMRobertaModel": "xlm-roberta",
    "RobertaModel": "xlm-roberta",
    "NomicBertModel": "nomic_bert",
}
DECODER = "decoder"  # any mlx-lm architecture, pooled at its last token
EMBEDDING = "embedding"
COMPLETION = "completion"
KINDS = (COMPLETION, EMBEDDING)


@dataclass(frozen=True)
class EmbeddingSpec:
    """How one embedding model turns texts into vectors."""

    family: str  # "bert", "xlm-roberta", "nomic_bert" or "decoder"
    pooling: str  # "cls", "mean" or "last"
    max_length: int  # tokens per input, special tokens included
    dimensions: int  # the vector's length
    query_prefix: str = ""
    document_prefix: str = ""
    append_eos: int | None = None  # decoders: the token every input must end with

    def limit(self, num_ctx: int | None) -> int:
        """Tokens per input where a `num_ctx` (the request's, or its entry's) narrows them."""
        return min(num_ctx, self.max_length) if num_ctx else self.max_length

    def entry_limit(self, entry: ModelEntry) -> int:
        """Tokens per input under the entry's own options (what it reports as its context);
        options a request would be refused for leave the model's."""
        try:
            return self.limit(parse_options(entry.options).num_ctx)
        except OptionsError:
            return self.max_length

    def prefix(self, role: str | None) -> str:
        """`role` "query" or "document" picks the table's prefix; any other text is itself the
        prefix (as Open WebUI's prefix field sends it); None adds nothing (Ollama's vectors)."""
        if role is None:
            return ""
        if role == "query":
            return self.query_prefix
        if role == "document":
            return self.document_prefix
        return role


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _family(config: dict[str, Any]) -> str | None:
    family = ENCODER_TYPES.get(str(config.get("model_type", "")))
    if family:
        return family
    for arch in config.get("architectures") or ():
        if arch in ENCODER_ARCHITECTURES:
            return ENCODER_ARCHITECTURES[arch]
    return None


def _st_pooling(model_dir: Path) -> str | None:
    """sentence-transformers' `1_Pooling/config.json`, when the repo kept it."""
    cfg = _read_json(model_dir / "1_Pooling" / "config.json")
    if cfg.get("pooling_mode_cls_token"):
        return CLS
    if cfg.get("pooling_mode_lasttoken"):
        return LAST
    if cfg.get("pooling_mode_mean_tokens"):
        return MEAN
    return None


def _st_prompts(model_dir: Path) -> dict[str, str]:
    prompts = _read_json(model_dir / "config_sentence_transformers.json").get("prompts")
    if not isinstance(prompts, dict):
        return {}
    return {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)}


def _has_st_files(model_dir: Path) -> bool:
    return any(
        (model_dir / name).exists()
        for name in ("modules.json", "config_sentence_transformers.json", "1_Pooling")
    )


def _max_length(
    entry: ModelEntry, config: dict[str, Any], family: str, model_dir: Path, row: KnownModel | None
) -> int:
    """Tokens per input: the registry's context_length, else sentence-transformers' own
    limit, else the table's (within the position table), else the config's positions."""
    if entry.context_length:
        return entry.context_length
    st = _positive(_read_json(model_dir / "sentence_bert_config.json").get("max_seq_length"))
    if st:
        return st
    positions = _positive(config.get("max_position_embeddings")) or _positive(
        config.get("n_positions")
    )
    if family == "xlm-roberta" and positions:
        positions -= (_positive(config.get("pad_token_id")) or 1) + 1  # positions start after pad
    if row is not None and row.max_length:
        rotary = family in ("nomic_bert", DECODER)  # no learned table to run out of
        return row.max_length if rotary or not positions else min(row.max_length, positions)
    return positions or 512


def _eos(config: dict[str, Any]) -> int | None:
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def spec_from_dir(entry: ModelEntry, model_dir: Path) -> EmbeddingSpec | None:
    """The spec of the model in `model_dir` registered as `entry`; None when it generates."""
    if entry.kind == COMPLETION:
        return None
    config = _read_json(model_dir / "config.json")
    names = [entry.name, entry.target, model_dir.name, str(config.get("_name_or_path", ""))]
    row = known_model(*names)
    family = _family(config)
    if family is None:
        if entry.kind != EMBEDDING and row is None and not _has_st_files(model_dir):
            return None
        family = DECODER
    pooling = entry.pooling or _st_pooling(model_dir) or (row.pooling if row else None)
    if pooling not in POOLINGS:
        pooling = LAST if family == DECODER else MEAN
    prompts = _st_prompts(model_dir)
    query = row.query_prefix if row else prompts.get("query", "")
    document = row.document_prefix if row else prompts.get("document", prompts.get("passage", ""))
    hidden = _positive(config.get("hidden_size")) or _positive(config.get("n_embd")) or 0
    return EmbeddingSpec(
        family=family,
        pooling=pooling,
        max_length=_max_length(entry, config, family, model_dir, row),
        dimensions=hidden,
        query_prefix=query,
        document_prefix=document,
        append_eos=_eos(config) if family == DECODER and pooling == LAST else None,
    )


@functools.lru_cache(maxsize=256)
def _cached(entry: ModelEntry, model_dir: str) -> EmbeddingSpec | None:
    return spec_from_dir(entry, Path(model_dir))


def embedding_spec(entry: ModelEntry) -> EmbeddingSpec | None:
    """The spec of `entry`'s model when it embeds (blocking: may look in the hub cache); None
    for generative models and for models that are not pulled yet."""
    if entry.kind == COMPLETION:
        return None
    path = resolve_local(entry.target)
    return None if path is None else _cached(entry, str(path))


def is_generative(entry: ModelEntry) -> bool:
    """True when `entry`'s files are present and they are not an embedding model's."""
    if entry.kind == COMPLETION:
        return True
    path = resolve_local(entry.target)
    return path is not None and _cached(entry, str(path)) is None
