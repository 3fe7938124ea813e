"""Prompt lookup on the device finds what the host's lookup finds after the same tokens."""

from __future__ import annotations

import random

import mlx.core as mx

from mlxd.engine.devicelookup import device_lookup
from mlxd.engine.drafting import LookupDraftSource


def host_lookup(committed: list[int], count: int) -> tuple[list[int], int]:
    """The host's filler after `committed`, padded with 0 as the device's is, and how many
    tokens its lookup proper (a match of two tokens or more) drafts there."""
    source = LookupDraftSource(max_ngram=4, min_ngram=2)
    source.prefill(committed)
    found = source.filler(committed, count)
    return found + [0] * (count - len(found)), len(source.follow(committed, count))


def test_device_lookup_matches_the_hosts_after_what_the_round_in_flight_commits() -> None:
    """Rows of random text over few tokens (so n-grams of every length recur), each with a
    round in flight of 0-5 drafts of which a random number is accepted and a next token: the
    device's drafts are the host's filler after the tokens the row then holds, including
    continuations that run into the accepted drafts and stop at the next token; and it
    counts as drafted what a match of two tokens or more found, as the host's lookup does."""
    rng = random.Random(7)
    count, m = 9, 5
    for trial in range(40):
        rows = 4
        windows = [[rng.randrange(1, 6) for _ in range(rng.randrange(0, 40))] for _ in range(rows)]
        inflight = [[rng.randrange(1, 6) for _ in range(m)] for _ in range(rows)]
        kept = [rng.randrange(1, m + 2) for _ in range(rows)]
        nexts = [rng.randrange(1, 6) for _ in range(rows)]
        got, drafted = device_lookup(
            windows,
            mx.array(inflight, dtype=mx.uint32),
            mx.array(kept, dtype=mx.int32),
            mx.array(nexts, dtype=mx.uint32),
            count,
        )
        for i in range(rows):
            committed = windows[i] + inflight[i][: kept[i] - 1] + [nexts[i]]
            host = host_lookup(committed, count)
            assert (got.tolist()[i], drafted.tolist()[i]) == host, (trial, i)


def test_device_lookup_with_no_round_in_flight_and_nothing_to_find() -> None:
    """A plain round in flight (no drafts, one token kept); a token never seen before gives
    nothing, and so does an empty window."""
    got, drafted = device_lookup(
        [[1, 2, 3, 1, 2, 4], [1, 2, 3], []],
        mx.zeros((3, 0), dtype=mx.uint32),
        mx.ones((3,), dtype=mx.int32),
        mx.array([3, 9, 1], dtype=mx.uint32),
        3,
    )
    assert got.tolist() == [[1, 2, 4], [0, 0, 0], [0, 0, 0]]
    assert drafted.tolist() == [0, 0, 0]  # a one-token match: fillers only
