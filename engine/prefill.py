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

Several short prompts waiting together are read as rows of one forward (`feed_rows`): one weight
read instead of one per prompt. On a GPU the row count is padded to a power of two as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxd.engine import kvcache
from mlxd.engine.progress import beat

CHUNK = 2048  # as mlx-lm's prefill step: on an H200, 7k tokens read in 379 ms against 508 at 512


def bucketed(model: nn.Module) -> bool:
    """Whether `model`'s caches are bucketed: then forward shapes are kept to a few that recur."""
    return kvcache.bucket_of(model) is not None


def chunk_sizes(n: int, limit: int = CHUNK, shaped: bool = False) -> list[int]:
    """Chunk lengths summing to `n`: `limit`-sized, and with `shaped` (where the caches are
    bucketed) the rest in descending powers of two (`limit` must then be one too)."""
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
        shaped = bucketed(model)
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
            beat()  # a long prompt is progress, not a stuck step
    assert logits is not None
    return logits


def batchable(cache: list[Any]) -> bool:
    """True for an empty cache whose layers are all plain KV caches (rows of one forward)."""
    return all(
        (type(c) is KVCache or isinstance(c, kvcache.BucketedKVCache))
        and c.keys is None
        and c.offset == 0
        for c in cache
    )


def row_shape(rows: int, longest: int, shaped: bool) -> tuple[int, int]:
    """(rows, width) of the forward `feed_rows` runs: powers of two where shapes compile (the
    caches are bucketed)."""
    if not shaped:
        return rows, longest
    return 1 << (rows - 1).bit_length(), 1 << (longest - 1).bit_length()


def feed_rows(
    model: nn.Module,
    caches: list[list[Any]],
    prompts: list[Sequence[int]],
    shaped: bool | None = None,
) -> None:
    """Read each prompt into its own empty, `batchable` cache, all in one forward.

    Prompts are right-padded to one width (causal attention: what follows a prompt cannot
    change it) and each row's cache then ends at its own prompt; a padded-in row repeats the
    first prompt and is dropped. Nothing is evaluated here.
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("feed_rows() needs at least one token per prompt")
    if shaped is None:
        shaped = bucketed(model)
    rows, width = row_shape(len(prompts), max(len(p) for p in prompts), shaped)
    padded = [list(p) + [p[-1]] * (width - len(p)) for p in prompts]
    padded += padded[:1] * (rows - len(prompts))
    batch = [type(c)() for c in caches[0]]
    model(mx.array(padded, dtype=mx.uint32), cache=batch)
    for row, (cache, prompt) in enumerate(zip(caches, prompts, strict=True)):
        for c, b in zip(cache, batch, strict=True):
            c.keys, c.values = b.keys[row : row + 1], b.values[row : row + 1]
            c.offset = len(prompt)


LOGIT_WIDTHS = 16  # chunks this narrow also have their logits read (a draft catching up)


def warm_shapes(model: nn.Module, context: int = CHUNK) -> None:
    """Compile every shaped chunk a prompt of up to `context` tokens read from the start can
    take (bucketed caches: shapes compile): each width at each `EXACT_ALIGN`-aligned offset,
    where chunks begin (wide ones attend over the exact keys there, so each offset is a shape
    of its own), each followed by a decode step. Widths go up, so the buffer has the capacity
    a prompt that ends there gives it (what attention reads depends on it). Each forward is
    evaluated as the engine evaluates it: a prompt chunk's K/V alone (its logits are never
    read, and what a GPU fuses and compiles depends on what is evaluated), a narrow chunk's
    logits as well (a draft catching up), a decode step's logits."""
    if not bucketed(model):
        return
    cache = kvcache.make_cache(model)
    if not paddable(cache):  # one feed of 2*CHUNK-1 tokens runs every power-of-two piece
        feed(model, cache, [0] * (2 * CHUNK - 1))
        mx.eval([c.state for c in cache])
        return
    offset = 0
    while True:
        width = 1
        while width <= CHUNK:
            _warm(model, cache, width)
            width <<= 1
        offset += kvcache.EXACT_ALIGN
        if offset + 1 >= context:
            return
        feed(model, cache, [0] * kvcache.EXACT_ALIGN)
        mx.eval([c.state for c in cache])


def _warm(model: nn.Module, cache: list[Any], width: int) -> None:
    """One chunk of `width` tokens and a decode step after it, taken back off the cache."""
    feed(model, cache, [0] * width)
    mx.eval([c.state for c in cache])
    if width <= LOGIT_WIDTHS:
        for c in cache:
            c.trim(width)
        mx.eval(feed(model, cache, [0] * width))
    mx.eval(model(mx.zeros((1, 1), dtype=mx.uint32), cache=cache)[0, -1:, :])
    for c in cache:
        c.trim(width + 1)
