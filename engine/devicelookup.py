"""Prompt lookup on the device, for rounds queued before the round in flight is read.

A batch queues its next verify round while the device still computes the one before
(`engine.batch`), so the host does not yet know what that round commits: how many of its
drafts it accepts and its next token. Drafts the host looks up must guess that outcome, and a
wrong guess wastes them. Here the lookup runs on the device instead, after the committed
tokens as they will be: each row's latest tokens (`window`, from the host), the round in
flight's drafts up to its accepted count and its next token (both still on the device). It
finds what `LookupDraftSource.filler` finds on the host: the continuation of the latest
earlier occurrence of the longest trailing n-gram (4 tokens down to 1), so its drafts always
follow what the row commits. A few dozen small operations for the whole batch.
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
    (`LookupDraftSource.propose`; a one-token match is a filler's)."""
    rows = len(windows)
    seq = mx.concatenate(
        [_windows(windows), inflight.astype(mx.int32), mx.full((rows, 1), NONE, mx.int32)], axis=1
    )
    span = seq.shape[1]
    pos = mx.arange(span)[None]
    last = (span - inflight.shape[1] - 2 + kept.astype(mx.int32)).reshape(rows, 1)
    seq = mx.where(pos == last, nexts.astype(mx.int32).reshape(rows, 1), seq)
    seq = mx.where(pos > last, NONE, seq)
    best = mx.full((rows,), NONE, mx.int32)
    length = mx.zeros((rows,), mx.int32)  # the n of the match found
    ends = pos < last  # an occurrence ends before the last token: its continuation is known
    match = ends
    for j in range(MAX_NGRAM):
        tail = mx.take_along_axis(seq, mx.maximum(last - j, 0), axis=1)  # (rows, 1)
        before = mx.concatenate([mx.full((rows, j), NONE - 1, mx.int32), seq[:, : span - j]], 1)
        match = match & (before == tail) & (tail >= 0)
        found = mx.max(mx.where(match, pos, NONE), axis=1)
        best = mx.where(found >= 0, found, best)  # a longer match wins
        length = mx.where(found >= 0, j + 1, length)
    at = best[:, None] + 1 + mx.arange(count)[None]
    known = (best[:, None] >= 0) & (at <= last)
    drafts = mx.take_along_axis(seq, mx.clip(at, 0, span - 1), axis=1)
    drafted = mx.where(length >= 2, known.sum(axis=1), 0).astype(mx.int32)
    return mx.where(known, drafts, 0).astype(mx.uint32), drafted
