"""Prompt lookup on the device, for rounds queued before the round in flight is read.

A batch queues its next verify round while the device still computes the one before
(`engine.batch`), so the host does not yet know what that round commits: how many of its
drafts it accepts and its next token. Drafts the host looks up must guess that outcome, and a
wrong guess wastes them. Here the lookup runs on the device instead, after the committed
tokens as they will be: each row's latest tokens (`window`, from the host), the round in
flight's drafts up to its accepted count and its next token (both still on the device). It
finds what `LookupDraftSource.filler` finds on the host: the continuation of the latest
earlier occurrence of the longest trailing n-gram (4 tokens down to 1), so its drafts always
follow what the row commits. About 40 small operations for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

WINDOW = 1024  # a row's latest committed tokens the lookup searches
MAX_NGRAM = 4
NONE = -1  # no token: padding before a short window, positions past what is committed


def _windows(windows: Sequence[Sequence[int]]) -> mx.array:
    """(rows, span) int32, each row's tokens right-aligned after `NONE`s (span >= MAX_NGRAM)."""
    span = max(MAX_NGRAM, max((len(w) for w in windows), default=0))
    out = np.full((len(windows), span), NONE, dtype=np.int32)
    for i, w in enumerate(windows):
        if len(w):
            out[i, span - len(w) :] = w
    return mx.array(out)


def _shifts(span: int) -> tuple[mx.array, mx.array]:
    """(MAX_NGRAM, span) int32 positions p - j for j < MAX_NGRAM (clipped at 0), and where
    p - j is a position at all."""
    at = np.arange(span)[None] - np.arange(MAX_NGRAM)[:, None]
    return mx.array(np.maximum(at, 0).astype(np.int32)), mx.array(at >= 0)


def _ints(values: np.ndarray) -> mx.array:
    """A constant built on the host: it costs the device no operation."""
    return mx.array(values.astype(np.int32))


def device_lookup(
    windows: Sequence[Sequence[int]],
    inflight: mx.array,
    kept: mx.array,
    nexts: mx.array,
    count: int,
) -> tuple[mx.array, mx.array]:
    """(rows, count) uint32 drafts: for row i, what followed the latest earlier occurrence of
    the longest trailing n-gram of its committed tokens, which are `windows[i]` (committed, on
    the host), then the first `kept[i] - 1` of `inflight[i]` (the round in flight's drafts,
    (rows, m)) and `nexts[i]` (its next token). 0 where nothing is known: no occurrence, or a
    continuation that reaches past the last committed token. And (rows,) int32: how many of
    row i's drafts a match of two tokens or more found, what prompt lookup itself drafts on
    (`LookupDraftSource.propose`; a one-token match is a filler's).

    Every n-gram length is compared at once: position p matches j + 1 tokens where the j + 1
    tokens ending at p equal the last j + 1 committed, and the longest match wins, the latest
    among equals (one maximum of length x span + p): 39 operations for the batch, each a
    kernel the host encodes on a GPU, where a loop over the lengths took 87."""
    rows = len(windows)
    none = _ints(np.full((rows, 1), NONE))
    seq = mx.concatenate([_windows(windows), inflight.astype(mx.int32), none], axis=1)
    span = seq.shape[1]
    pos = _ints(np.arange(span)[None])
    last = (span - inflight.shape[1] - 2 + kept.astype(mx.int32)).reshape(rows, 1)
    before = pos < last  # committed before the last token: an occurrence's continuation is known
    seq = mx.where(before, seq, mx.where(pos == last, nexts.astype(mx.int32)[:, None], NONE))
    shifted, inside = _shifts(span)
    tails = mx.take_along_axis(seq, last - _ints(np.arange(MAX_NGRAM)[None]), axis=1)
    same = (seq[:, shifted] == tails[:, :, None]) & inside & (tails >= 0)[:, :, None]
    length = mx.cumprod(same.astype(mx.int32), axis=1).sum(axis=1)  # (rows, span)
    score = mx.max(mx.where(before & (length > 0), length * span + pos, -1), axis=1)
    at = score[:, None] % span + _ints(1 + np.arange(count)[None])
    known = (score >= 0)[:, None] & (at <= last)
    drafts = mx.take_along_axis(seq, mx.minimum(at, span - 1), axis=1)
    drafted = mx.where(score >= 2 * span, known.sum(axis=1), 0).astype(mx.int32)
    return mx.where(known, drafts, 0).astype(mx.uint32), drafted
