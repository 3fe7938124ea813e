"""Feeding prompt tokens into a cache in chunks whose shapes recur.

On MLX's CUDA backend every new shape of a multi-token forward costs a graph compile (~40 ms,
more than the forward itself for a short prompt). With the bucketed caches the key length is the
allocated buffer, so the chunk length is the only shape left: on a GPU every chunk is a power of
two (a 300-token prompt runs as 256 + 32 + 8 + 4), a handful of shapes that probe-open warms. On
the CPU there is nothing to compile and each extra forward re-reads the weights, so chunks are
plain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine import kvcache

CHUNK = 512


def chunk_sizes(n: int, limit: int = CHUNK, shaped: bool | None = None) -> list[int]:
    """Chunk lengths summing to `n`: `limit`-sized, and with `shaped` (default: when the caches
    are bucketed) the rest in descending powers of two (`limit` must then be one too)."""
    if shaped is None:
        shaped = kvcache.BUCKETED
    sizes = [limit] * (n // limit)
    rest = n - limit * len(sizes)
    if not shaped:
        return sizes + ([rest] if rest else [])
    bit = limit
    while rest:
        bit >>= 1
        if rest >= bit:
            sizes.append(bit)
            rest -= bit
    return sizes


def feed(
    model: nn.Module, cache: list[Any], tokens: Sequence[int], shaped: bool | None = None
) -> mx.array:
    """Run `tokens` through `model`; returns the logits of the last position (1, V)."""
    if not tokens:
        raise ValueError("feed() needs at least one token")
    sizes = chunk_sizes(len(tokens), shaped=shaped)
    logits = None
    start = pending = 0
    for size in sizes:
        chunk = mx.array(list(tokens[start : start + size]), dtype=mx.uint32)[None]
        logits = model(chunk, cache=cache)[0, -1:, :]
        start += size
        pending += size
        if pending >= CHUNK and start < len(tokens):  # bound the lazy graph, not every piece
            mx.eval([c.state for c in cache])
            pending = 0
    assert logits is not None
    return logits


def warm_shapes(model: nn.Module) -> None:
    """Compile every shaped chunk length in the first bucket: one feed of 2*CHUNK-1 tokens runs
    them all."""
    if kvcache.ON_GPU:
        mx.eval(feed(model, kvcache.make_cache(model), [0] * (2 * CHUNK - 1)))
