"""The NomicBERT encoder (nomic-embed-text) on mlx, named as its checkpoint is.

A BERT whose positions are rotary (no position table, so long inputs need no learned rows),
whose attention projects Q, K and V with one fused `Wqkv`, and whose MLP is SwiGLU
(`fc11(x) * silu(fc12(x))`); blocks are post-norm like BERT's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.embedding.bert import attend, merge_heads, split_heads


class NomicEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim = cfg["n_embd"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], dim)
        self.token_type_embeddings = nn.Embedding(max(1, cfg.get("type_vocab_size") or 1), dim)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.word_embeddings(ids) + self.token_type_embeddings(mx.zeros_like(ids))


class NomicAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim = cfg["n_embd"]
        self.heads = cfg["n_head"]
        head_dim = dim // self.heads
        self.rotary_dims = int(head_dim * float(cfg.get("rotary_emb_fraction") or 1.0))
        self.base = float(cfg.get("rotary_emb_base") or 10000.0)
        self.traditional = bool(cfg.get("rotary_emb_interleaved"))
        bias = bool(cfg.get("qkv_proj_bias", False))
        self.Wqkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def rope(self, x: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.rotary_dims, traditional=self.traditional, base=self.base, scale=1.0, offset=0
        )

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        q, k, v = (split_heads(t, self.heads) for t in mx.split(self.Wqkv(x), 3, axis=-1))
        return self.out_proj(merge_heads(attend(self.rope(q), self.rope(k), v, mask)))


class NomicMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        dim, hidden = cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
        bias1, bias2 = bool(cfg.get("mlp_fc1_bias", False)), bool(cfg.get("mlp_fc2_bias", False))
        self.fc11 = nn.Linear(dim, hidden, bias=bias1)
        self.fc12 = nn.Linear(dim, hidden, bias=bias1)
        self.fc2 = nn.Linear(hidden, dim, bias=bias2)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.fc11(x) * nn.silu(self.fc12(x)))


class NomicLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        eps = cfg.get("layer_norm_epsilon", 1e-12)
        self.attn = NomicAttention(cfg)
        self.mlp = NomicMLP(cfg)
        self.norm1 = nn.LayerNorm(cfg["n_embd"], eps=eps)
        self.norm2 = nn.LayerNorm(cfg["n_embd"], eps=eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.norm1(self.attn(x, mask) + x)
        return self.norm2(self.mlp(x) + x)


class NomicEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.layers = [NomicLayer(cfg) for _ in range(cfg["n_layer"])]


class NomicBertModel(nn.Module):
    """Hidden states of the last layer, (B, L, n_embd), for right-padded `ids`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("prenorm"):
            raise ValueError("pre-norm NomicBERT checkpoints are not supported")
        if str(cfg.get("activation_function", "swiglu")) != "swiglu":
            raise ValueError(f"unsupported activation {cfg.get('activation_function')!r}")
        self.embeddings = NomicEmbeddings(cfg)
        self.emb_ln = nn.LayerNorm(cfg["n_embd"], eps=cfg.get("layer_norm_epsilon", 1e-12))
        self.encoder = NomicEncoder(cfg)

    def __call__(self, ids: mx.array, mask: mx.array) -> mx.array:
        x = self.emb_ln(self.embeddings(ids))
        keys = mask[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, keys)
        return x

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("model.").removeprefix("bert.")
            if key.startswith(("embeddings.", "emb_ln.", "encoder.")):
                out[key] = value
        return out
