"""Lossless verification of a draft against the target's logits over [pending] + drafts.

Greedy: accept while the target's argmax equals the draft; the first mismatch (or the bonus
position) contributes the target's own token, so the output is the target's greedy output.
Sampled: speculative sampling (accept with min(1, p/q), resample from norm(max(0, p - q))), so
the emitted distribution is exactly the target's. A deterministic proposal (prompt lookup) is a
point mass q, which makes the residual "p without the rejected token".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxd.engine.drafting import Draft
from mlxd.engine.options import SamplingOptions
from mlxd.engine.sampling import Rng, penalize, probabilities, sample, to_int, to_ints


@dataclass(frozen=True)
class Verdict:
    """How many drafts were accepted and the tokens this round commits (accepted + one)."""

    accepted: int
    tokens: list[int]


def verify(
    logits: mx.array,
    draft: Draft,
    history: Sequence[int],
    opts: SamplingOptions,
    rng: Rng,
) -> Verdict:
    """`logits` is (n + 1, V) for [pending] + n drafts; `history` ends with the pending token."""
    n = draft.count
    if opts.has_penalties:  # penalties need the drafts on the host before the target's rows
        logits = penalize(logits, history, to_ints(draft.tokens) if n else [], opts)
    # Everything below stays lazy until one eval: the draft chain, the verify forward and the
    # acceptance test run as one graph, with one host sync per round.
    if opts.greedy:
        choice_arr = mx.argmax(logits, axis=-1)
        mx.eval(draft.tokens, choice_arr)
        drafts, choice = to_ints(draft.tokens) if n else [], to_ints(choice_arr)
        a = 0
        while a < n and drafts[a] == choice[a]:
            a += 1
        return Verdict(a, [*drafts[:a], choice[a]])

    p = probabilities(logits, opts)
    if n == 0:
        return Verdict(0, [to_int(sample(p, rng.next()))])
    idx = draft.tokens.astype(mx.uint32)
    if draft.probs is not None:
        q = draft.probs
    else:
        q = (mx.arange(p.shape[-1])[None, :] == idx[:, None]).astype(p.dtype)
    rows = mx.arange(n)
    p_d = p[rows, idx]
    q_d = q[rows, idx]
    u = mx.random.uniform(shape=(n,), key=rng.next())
    accept = u * q_d < p_d  # u < min(1, p/q) without dividing by zero
    residual = mx.maximum(p[:n] - q, 0.0)
    mass = mx.sum(residual, axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:n])
    resampled = sample(residual, rng.next())
    bonus = sample(p[n : n + 1], rng.next())
    mx.eval(idx, accept, resampled, bonus)
    drafts, ok = to_ints(idx), to_ints(accept)
    a = 0
    while a < n and ok[a]:
        a += 1
    last = to_int(bonus) if a == n else to_int(resampled[a])
    return Verdict(a, [*drafts[:a], last])
