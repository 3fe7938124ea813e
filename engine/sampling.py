"""Logit shaping and seeded sampling shared by plain decoding, drafting and verification.

One shaping path for every consumer is what makes speculation lossless: the draft's q and the
target's p go through exactly the same penalties, top-k, temperature, top-p and min-p.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import mlx.core as mx

from mlxd.engine.options import SamplingOptions


class Rng:
    """A per-request PRNG key chain: seeded requests replay exactly, others draw fresh entropy."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def to_ints(a: mx.array) -> list[int]:
    """Token ids on the host (mlx's tolist is typed for any nesting)."""
    return [int(t) for t in a.reshape(-1).tolist()]  # type: ignore[union-attr, arg-type]


def to_int(a: mx.array) -> int:
    return int(a.item())  # type: ignore[arg-type]


def penalize(
    logits: mx.array, history: Sequence[int], extra: Sequence[int], opts: SamplingOptions
) -> mx.array:
    """Apply repeat/presence/frequency penalties to each row of `logits` (L, V).

    Row i sees the history `history + extra[:i]`, so a verify forward over drafts is penalized
    exactly as the same tokens decoded one by one would be.
    """
    if not opts.has_penalties:
        return logits
    window = opts.repeat_last_n if opts.repeat_last_n > 0 else len(history) + len(extra)
    rows = []
    for i in range(logits.shape[0]):
        seen = (list(history) + list(extra[:i]))[-window:]
        row = logits[i]
        if seen:
            counts = Counter(seen)
            ids = mx.array(list(counts.keys()))
            cnt = mx.array(list(counts.values()), dtype=row.dtype)
            sel = row[ids]
            if opts.repeat_penalty != 1.0:
                sel = mx.where(sel > 0, sel / opts.repeat_penalty, sel * opts.repeat_penalty)
            sel = sel - opts.presence_penalty - opts.frequency_penalty * cnt
            row[ids] = sel
        rows.append(row)
    return mx.stack(rows)


def probabilities(logits: mx.array, opts: SamplingOptions) -> mx.array:
    """The sampling distribution for each row: top-k, temperature, top-p, min-p, renormalized."""
    logits = logits.astype(mx.float32)
    vocab = logits.shape[-1]
    if 0 < opts.top_k < vocab:
        kth = mx.min(mx.topk(logits, opts.top_k, axis=-1), axis=-1, keepdims=True)
        logits = mx.where(logits >= kth, logits, -mx.inf)
    probs = mx.softmax(logits / opts.temperature, axis=-1)
    if opts.top_p < 1.0:
        desc = mx.sort(probs, axis=-1)[..., ::-1]
        before = mx.cumsum(desc, axis=-1) - desc
        cutoff = mx.min(mx.where(before < opts.top_p, desc, mx.inf), axis=-1, keepdims=True)
        probs = mx.where(probs >= cutoff, probs, 0.0)
    if opts.min_p > 0.0:
        floor = opts.min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs >= floor, probs, 0.0)
    return probs / mx.sum(probs, axis=-1, keepdims=True)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token per row of `probs` (L, V) -> (L,) uint32."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


def next_tokens(
    logits: mx.array,
    history: Sequence[int],
    extra: Sequence[int],
    opts: SamplingOptions,
    rng: Rng,
) -> tuple[mx.array, mx.array | None]:
    """Choose one token per row; returns (tokens, probs) with probs None when greedy."""
    logits = penalize(logits, history, extra, opts)
    if opts.greedy:
        return mx.argmax(logits, axis=-1), None
    probs = probabilities(logits, opts)
    return sample(probs, rng.next()), probs
