"""From a batch's hidden states to one unit vector per input."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxd.engine.embedding.table import CLS, LAST, MEAN


def pool(hidden: mx.array, mask: mx.array, lengths: mx.array, mode: str) -> mx.array:
    """(B, L, D) right-padded states -> (B, D): the first token (CLS), the mean over the real
    tokens (the pads excluded from sum and count), or the last real token (decoders)."""
    if mode == CLS:
        return hidden[:, 0, :]
    if mode == MEAN:
        weights = mask.astype(hidden.dtype)[:, :, None]
        return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1)
    if mode == LAST:
        index = (lengths - 1).astype(mx.int32)[:, None, None]
        return mx.take_along_axis(hidden, index, axis=1)[:, 0, :]
    raise ValueError(f"unknown pooling {mode!r}")


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 length, as Ollama returns every vector (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def truncate_dimensions(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Ollama's `dimensions`: keep the first n and renormalise; a larger n changes nothing."""
    if dimensions is None or dimensions <= 0 or dimensions >= vectors.shape[-1]:
        return vectors
    return normalize(vectors[:, :dimensions])
