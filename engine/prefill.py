"""Feeding prompt tokens into a cache in chunks whose shapes recur.

On MLX's CUDA backend every new shape of a multi-token forward costs a graph compile (~40 ms,
more than the forward itself for a short prompt). With the bucketed caches the key length is the
allocated buffer, so the chunk length is the only shape left: on a GPU every chunk is a power of
two. Where every layer is a bucketed KV cache, the last chunk is right-padded up to its power of
two and the padding trimmed off after the forward (causal attention: padding after the prompt
cannot change it), so a 300-token prompt is one 512-wide forward; other caches (recurrent state,
rotating windows) cannot take that back, so theirs runs as 256 + 32 + 8 + 4. Either way a handful
of shapes, which probe-open warms. On the CPU there is nothing to compile and each extra forward
re-reads the weights, so chunks are plain.
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


def paddable(cache: list[Any]) -> bool:
    """True when every layer can drop trailing positions again (see the module docstring)."""
    return all(isinstance(c, kvcache.BucketedKVCache) for c in cache)


def padded_sizes(n: int, limit: int = CHUNK) -> list[int]:
    """Forward widths for `n` tokens with a padded last chunk: `limit`s, then one power of two."""
    sizes = [limit] * (n // limit)
    rest = n - limit * len(sizes)
    if rest:
        sizes.append(1 << (rest - 1).bit_length())
    return sizes


def feed(
    model: nn.Module, cache: list[Any], tokens: Sequence[int], shaped: bool | None = None
) -> mx.array:
    """Run `tokens` through `model`; returns the logits of the last position (1, V)."""
    if not tokens:
        raise ValueError("feed() needs at least one token")
    if shaped is None:
        shaped = kvcache.BUCKETED
    padded = shaped and paddable(cache)
    sizes = padded_sizes(len(tokens)) if padded else chunk_sizes(len(tokens), shaped=shaped)
    logits = None
    start = pending = 0
    for width in sizes:
        piece = list(tokens[start : start + width])
        size, pad = len(piece), width - len(piece)
        chunk = mx.array(piece + piece[-1:] * pad, dtype=mx.uint32)[None]
        logits = model(chunk, cache=cache)[0, size - 1 : size, :]
        if pad:
            for c in cache:
                c.trim(pad)
        start += size
        pending += size
        if pending >= CHUNK and start < len(tokens):  # bound the lazy graph, not every piece
            mx.eval([c.state for c in cache])
            pending = 0
    assert logits is not None
    return logits


def warm_shapes(model: nn.Module) -> None:
    """Compile every shaped chunk width in the first bucket."""
    if not kvcache.ON_GPU:
        return
    cache = kvcache.make_cache(model)
    if not paddable(cache):  # one feed of 2*CHUNK-1 tokens runs every power-of-two piece
        mx.eval(feed(model, cache, [0] * (2 * CHUNK - 1)))
        return
    width = CHUNK
    while width:
        mx.eval(feed(model, cache, [0] * width))
        for c in cache:
            c.trim(width)
        width >>= 1
