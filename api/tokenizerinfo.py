"""The `tokenizer.ggml.*` keys Ollama's `/api/show` puts in `model_info`, read from a Hugging Face
`tokenizer.json` (no model loaded).

As Ollama, the long arrays (tokens, token types, merges) are emptied unless `verbose` asks for
them: a full vocabulary is megabytes of JSON that most clients never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# GGUF's token types
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
# Hugging Face model types as GGUF names them
MODELS = {"BPE": "gpt2", "Unigram": "llama", "WordPiece": "bert", "WordLevel": "word"}
SHORT = 5  # Ollama empties arrays longer than this unless verbose


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_id(name: Any, ids: dict[str, int]) -> int | None:
    if isinstance(name, dict):  # {"content": "<s>", ...}
        name = name.get("content")
    return ids.get(name) if isinstance(name, str) else None


def _merges(model: dict[str, Any]) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]


def tokenizer_info(model_dir: Path, verbose: bool) -> dict[str, Any]:
    """`tokenizer.ggml.*` for the model in `model_dir`; {} when it has no tokenizer.json."""
    spec = _json(model_dir / "tokenizer.json")
    model = spec.get("model")
    if not isinstance(model, dict):
        return {}
    vocab = model.get("vocab") or {}
    ids: dict[str, int] = dict(vocab) if isinstance(vocab, dict) else {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = {piece: i for i, (piece, _) in enumerate(vocab)}
    types = {i: NORMAL for i in ids.values()}
    for added in spec.get("added_tokens") or []:
        ids[added["content"]] = added["id"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    by_id = sorted(ids.items(), key=lambda kv: kv[1])
    config = _json(model_dir / "tokenizer_config.json")
    pre = spec.get("pre_tokenizer") or {}
    info: dict[str, Any] = {
        "tokenizer.ggml.model": MODELS.get(str(model.get("type")), str(model.get("type"))),
        "tokenizer.ggml.pre": str(pre.get("type", "default")).lower(),
        "tokenizer.ggml.tokens": [t for t, _ in by_id],
        "tokenizer.ggml.token_type": [types[i] for _, i in by_id],
        "tokenizer.ggml.merges": _merges(model),
        "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False)),
        "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False)),
    }
    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        token = _token_id(config.get(field), ids)
        if token is not None:
            info[f"tokenizer.ggml.{key}_token_id"] = token
    if isinstance(vocab, list):
        info["tokenizer.ggml.scores"] = [float(score) for _, score in vocab]
    if not verbose:
        for key, value in info.items():
            if isinstance(value, list) and len(value) > SHORT:
                info[key] = []
    return info
