"""BERT and XLM-RoBERTa encoders on mlx, named as their Hugging Face checkpoints are so the
weights load as they are (all-MiniLM, mxbai-embed-large, bge-m3, snowflake-arctic-embed).

One post-norm block: self-attention over the unpadded keys, then a GELU MLP, each added back
and layer-normed. XLM-RoBERTa differs only in where positions start (after the pad id).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
}


def activation(name: Any) -> Any:
    fn = ACTIVATIONS.get(str(name or "gelu"))
    if fn is None:
        raise ValueError(f"unsupported activation {name!r}")
    return fn


def attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array) -> mx.array:
    """(B, H, L, D) each; `mask` (B, 1, 1, L) true where a key is a real token."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def split_heads(x: mx.array, heads: int) -> mx.array:
    b, length, _ = x.shape
    return x.reshape(b, length, heads, -1).transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    b, _, length, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, length, -1)


class Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], dim)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], dim)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.get("type_vocab_size") or 1), dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=cfg.get("layer_norm_eps", 1e-12))

    def __call__(self, ids: mx.array, positions: mx.array) -> mx.array:
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(mx.zeros_like(ids))  # one segment: type 0
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)


class DenseNorm(nn.Module):
    """`dense`, then LayerNorm of it plus the residual (BERT's `*Output` blocks)."""

    def __init__(self, dims_in: int, dim: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(dims_in, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.self = SelfAttention(dim)  # the checkpoint's name
        self.output = DenseNorm(dim, dim, eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        proj = self.self
        q, k, v = (split_heads(p(x), self.heads) for p in (proj.query, proj.key, proj.value))
        return self.output(merge_heads(attend(q, k, v, mask)), x)


class Intermediate(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, hidden)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.attention = Attention(dim, cfg["num_attention_heads"], eps)
        self.intermediate = Intermediate(
            dim, cfg["intermediate_size"], activation(cfg.get("hidden_act"))
        )
        self.output = DenseNorm(cfg["intermediate_size"], dim, eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg["num_hidden_layers"])]


class BertModel(nn.Module):
    """Hidden states of the last layer, (B, L, hidden), for right-padded `ids`."""

    prefixes = ("bert.", "roberta.", "model.")

    def __init__(self, cfg: dict[str, Any], roberta: bool = False) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        # XLM-RoBERTa numbers positions from pad_token_id + 1 (RoBERTa's fairseq heritage)
        self.position_offset = (int(cfg.get("pad_token_id") or 1) + 1) if roberta else 0

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :] + self.position_offset
        x = self.embeddings(ids, positions)
        keys = mask[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, keys)
        return x

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The checkpoint's tensors under this module's names: wrapper prefixes dropped, old
        `gamma`/`beta` names renamed, heads this model does not use (pooler, MLM) left out."""
        out = {}
        for key, value in weights.items():
            for prefix in self.prefixes:
                if key.startswith(prefix):
                    key = key[len(prefix) :]
                    break
            if not key.startswith(("embeddings.", "encoder.")) or "position_ids" in key:
                continue
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight")
            key = key.replace("LayerNorm.beta", "LayerNorm.bias")
            out[key] = value
        return out
