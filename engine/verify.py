"""Lossless verification of a draft against the target's logits over [pending] + drafts.

The target chooses a token at every verified position exactly as plain decoding would: the
argmax when greedy, else the sample keyed by (seed, position) (`sampling`). A draft is accepted
while it equals the target's choice; the first mismatch (or the bonus position after the last
draft) contributes the target's own choice. Every emitted token is therefore the target's own,
so the output equals plain decoding's token for token, whatever the drafts were: byte-identical
when greedy, the target's distribution (and the same seeded tokens) when sampling. Drafts
sampled with the same position noise agree with the target whenever the two Gumbel argmaxes
coincide, which is where the acceptance comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxd.engine.branches import Grid
from mlxd.engine.drafting import Draft
from mlxd.engine.options import SamplingOptions
from mlxd.engine.sampling import Rng, choose, penalize, sample_keyed, to_ints


@dataclass(frozen=True)
class Verdict:
    """How many drafts were accepted and the tokens this round commits (accepted + one)."""

    accepted: int
    tokens: list[int]


def choices(
    logits: mx.array,
    drafts: Sequence[int],
    history: Sequence[int],
    opts: SamplingOptions,
    rng: Rng,
    bias: mx.array | None = None,
) -> mx.array:
    """The target's token at each of the (n + 1) positions of `logits`, lazily; `history`
    ends with the pending token, `drafts` are the n drafted tokens on the host. A grammar's
    `bias` (n + 1, V) masks each position as the grammar stands after the drafts before it
    (`grammar.walk`): the choice there is the masked target's, so acceptance stays lossless."""
    logits = penalize(logits, history, drafts, opts)
    return choose(logits, opts, rng, len(history), bias)


def decide(drafts: Sequence[int], chosen: Sequence[int]) -> Verdict:
    """Accept the drafts up to the first that differs from the target's choice."""
    a = 0
    while a < len(drafts) and drafts[a] == chosen[a]:
        a += 1
    return Verdict(a, [*drafts[:a], chosen[a]])


def verify(
    logits: mx.array,
    draft: Draft,
    history: Sequence[int],
    opts: SamplingOptions,
    rng: Rng,
    bias: mx.array | None = None,
) -> Verdict:
    """`logits` is (n + 1, V) for [pending] + n drafts; `history` ends with the pending token.
    The draft chain, the verify forward and the choices run as one graph with one host sync:
    the draft's tokens and the target's choices are evaluated together."""
    tokens = draft.tokens if draft.count else mx.array([], dtype=mx.uint32)
    if opts.has_penalties and draft.count:  # penalties need the drafts on the host first
        host = to_ints(tokens)
        chosen = choices(logits, host, history, opts, rng, bias)
        return decide(host, to_ints(chosen))
    chosen = choices(logits, [], history, opts, rng, bias)
    mx.eval(tokens, chosen)
    return decide(to_ints(tokens) if draft.count else [], to_ints(chosen))


def verify_grid(
    logits: mx.array, grid: Grid, history: Sequence[int], opts: SamplingOptions, rng: Rng
) -> tuple[int, Verdict]:
    """`logits` is (m(L+1), V) for `grid`'s branches side by side (`engine.branches`). Each
    branch's positions are chosen as they would be alone (the same noise keys: a branch's j-th
    token sits at the same position in every branch), so the branch that is accepted furthest
    commits exactly what plain decoding would. Returns that branch (the first of equals) and
    its verdict. No penalties or grammar: those verify one branch."""
    width = grid.width
    if opts.greedy:
        chosen = mx.argmax(logits, axis=-1)
    else:
        keys = rng.keys(len(history), width)
        chosen = sample_keyed(logits, opts, mx.tile(keys, (grid.count, 1)))
    host = to_ints(chosen)
    best, verdict = 0, decide(grid.drafts[0], host[:width])
    for b in range(1, grid.count):
        other = decide(grid.drafts[b], host[b * width : (b + 1) * width])
        if other.accepted > verdict.accepted:
            best, verdict = b, other
    return best, verdict
