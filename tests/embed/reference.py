"""Independent reference forwards in numpy for the tiny embedding models: one sequence at a
time, no padding, no mask, read straight from the safetensors bytes (no mlx involved)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
_erf = np.vectorize(math.erf)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        array = np.frombuffer(data[base + start : base + end], dtype=_DTYPES[info["dtype"]])
        out[name] = array.reshape(info["shape"]).astype(np.float64)
    return out


def _ln(x: np.ndarray, w: dict[str, np.ndarray], name: str, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight


def _lin(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def _softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> np.ndarray:
    """(H, L, D) each -> (L, H*D)."""
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[1]
        scores = scores + np.triu(np.full((length, length), -np.inf), 1)
    out = _softmax(scores) @ v
    return out.transpose(1, 0, 2).reshape(q.shape[1], -1)


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    return x.reshape(x.shape[0], heads, -1).transpose(1, 0, 2)


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """Rotate the two halves of each head (GPT-NeoX layout); x is (H, L, D)."""
    dims = x.shape[-1]
    half = dims // 2
    freqs = base ** (-np.arange(half) * 2.0 / dims)
    angles = np.arange(x.shape[1])[:, None] * freqs[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def bert_states(w: dict[str, np.ndarray], cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    roberta = cfg["model_type"] == "xlm-roberta"
    eps = cfg["layer_norm_eps"]
    heads = cfg["num_attention_heads"]
    offset = cfg["pad_token_id"] + 1 if roberta else 0
    positions = np.arange(len(ids)) + offset
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][positions]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _ln(x, w, "embeddings.LayerNorm", eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (
            _heads(_lin(x, w, f"{p}.attention.self.{n}"), heads) for n in ("query", "key", "value")
        )
        h = _ln(
            _lin(_attention(q, k, v), w, f"{p}.attention.output.dense") + x,
            w,
            f"{p}.attention.output.LayerNorm",
            eps,
        )
        mid = _gelu(_lin(h, w, f"{p}.intermediate.dense"))
        x = _ln(_lin(mid, w, f"{p}.output.dense") + h, w, f"{p}.output.LayerNorm", eps)
    return x


def nomic_states(w: dict[str, np.ndarray], cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    eps = cfg["layer_norm_epsilon"]
    heads = cfg["n_head"]
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _ln(x, w, "emb_ln", eps)
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}"
        q, k, v = np.split(_lin(x, w, f"{p}.attn.Wqkv"), 3, axis=-1)
        q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
        base = cfg["rotary_emb_base"]
        attn = _lin(_attention(_rope(q, base), _rope(k, base), v), w, f"{p}.attn.out_proj")
        x = _ln(attn + x, w, f"{p}.norm1", eps)
        mlp = _lin(
            _lin(x, w, f"{p}.mlp.fc11") * _silu(_lin(x, w, f"{p}.mlp.fc12")), w, f"{p}.mlp.fc2"
        )
        x = _ln(mlp + x, w, f"{p}.norm2", eps)
    return x


def qwen3_states(w: dict[str, np.ndarray], cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    w = {k.removeprefix("model."): v for k, v in w.items()}
    eps, base = cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    x = w["embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        h = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = _rms(
            _heads(_lin(h, w, f"{p}.self_attn.q_proj"), heads),
            w[f"{p}.self_attn.q_norm.weight"],
            eps,
        )
        k = _rms(
            _heads(_lin(h, w, f"{p}.self_attn.k_proj"), kv_heads),
            w[f"{p}.self_attn.k_norm.weight"],
            eps,
        )
        v = _heads(_lin(h, w, f"{p}.self_attn.v_proj"), kv_heads)
        group = heads // kv_heads
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        x = x + _lin(
            _attention(_rope(q, base), _rope(k, base), v, causal=True), w, f"{p}.self_attn.o_proj"
        )
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = _lin(h, w, f"{p}.mlp.gate_proj"), _lin(h, w, f"{p}.mlp.up_proj")
        x = x + _lin(_silu(gate) * up, w, f"{p}.mlp.down_proj")
    return _rms(x, w["norm.weight"], eps)


class Reference:
    """One tiny model's reference embedding: tokenize, forward, pool, L2-normalise."""

    def __init__(self, model_dir: Path, pooling: str) -> None:
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.weights = read_safetensors(model_dir / "model.safetensors")
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.pooling = pooling

    def ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text).ids)
        if self.cfg["model_type"] == "qwen3" and (not ids or ids[-1] != self.cfg["eos_token_id"]):
            ids.append(self.cfg["eos_token_id"])
        return ids

    def states(self, ids: list[int]) -> np.ndarray:
        kind = self.cfg["model_type"]
        if kind == "qwen3":
            return qwen3_states(self.weights, self.cfg, ids)
        if kind == "nomic_bert":
            return nomic_states(self.weights, self.cfg, ids)
        return bert_states(self.weights, self.cfg, ids)

    def embed_ids(self, ids: list[int]) -> np.ndarray:
        x = self.states(ids)
        pooled = {"cls": x[0], "mean": x.mean(0), "last": x[-1]}[self.pooling]
        return pooled / np.linalg.norm(pooled)

    def embed(self, text: str) -> np.ndarray:
        return self.embed_ids(self.ids(text))
