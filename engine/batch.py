"""Rows decoding together: one target forward per round over every row, speculation included.

The rows' K/V live in one batch cache per layer (mlx-lm's `BatchKVCache`: rows left-padded to
one write position, per-row offsets for RoPE and the mask). A round right-pads each row's input
[pending, drafts...] to the widest row, runs one forward, and every row accepts against its own
logits with its own position-keyed randomness (`verify`). Afterwards each row keeps exactly its
accepted length: the batch trims what no row kept, and a row that kept less is rolled right by
the difference (`prepare(right_padding=...)` + `finalize()`, as mlx-lm does for right-padded
prompts), so its rejected positions become left padding the mask already hides. A round where
no row drafts is plain batched decoding (width 1, the path the CUDA ragged-attention kernel
serves).

Per-row K/V lists stacked anew each round would copy every cache every token; the batch cache
copies a row only when it joins (merge, extend) or leaves (extract, filter), and rolls only in
rounds whose rows accepted different lengths.

How many drafts a round verifies is one choice for the batch: a width W costs one forward of
B x W tokens, estimated as the target's measured cost of a B*W-token forward (`Costs.v`,
linear past the widest measured width: conservative), plus each row's draft steps. The batch
picks the W with the most expected committed tokens per second, W = 1 (plain) included, so
speculation backs off as rows are added exactly where it stops paying.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine import kvcache
from mlxd.engine.adapters import selecting
from mlxd.engine.generation import Generation
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng, to_ints
from mlxd.engine.speculation import Costs
from mlxd.engine.verify import choices, decide

COMPACT = 64  # positions of left padding shared by every row before the batch cuts them


@dataclass
class Committed:
    """What one row committed in a round."""

    gen: Generation
    tokens: list[int]


def expected_tokens(gen: Generation, k: int) -> float:
    """Tokens a row expects to commit from a round with k drafts (1 when k = 0)."""
    if k <= 0 or gen.controller is None:
        return 1.0
    expected, survive = 1.0, 1.0
    for a in gen.controller.alphas(k, optimistic=True):
        survive *= a
        expected += survive
    return expected


def plan_widths(gens: Sequence[Generation], wants: Sequence[int], costs: Costs) -> list[int]:
    """Drafts per row for this round: the batch-wide width with the best expected rate."""
    rows = len(gens)
    best, best_rate = 0, rows / costs.v(rows)
    for k in sorted({w for w in wants if w > 0}):
        ks = [min(w, k) for w in wants]
        expected = sum(expected_tokens(g, n) for g, n in zip(gens, ks, strict=True))
        drafting = sum(
            n * (g.controller.draft_cost if g.controller is not None else 0.0)
            for g, n in zip(gens, ks, strict=True)
        )
        rate = expected / (costs.v(rows * (k + 1)) + drafting)
        if rate > best_rate:
            best, best_rate = k, rate
    return [min(w, best) for w in wants]


class RowBatch:
    """The rows stepped together and their batch cache; rows join and leave between rounds."""

    def __init__(self, target: nn.Module, costs: Costs) -> None:
        self.target = target
        self.costs = costs
        self.gens: list[Generation] = []
        self.cache: list[Any] = []

    def __len__(self) -> int:
        return len(self.gens)

    def __contains__(self, gen: Generation) -> bool:
        return any(g is gen for g in self.gens)

    def join(self, gens: Sequence[Generation]) -> None:
        """Move rows' caches into the batch. Each must hold every committed token but the
        last (`Generation.settle`) in plain K/V layers (`Generation.batchable`)."""
        if not gens:
            return
        kind = kvcache.batch_type(self.target)
        layers = len(gens[0].cache)
        merged = [kind.merge([g.cache[i] for g in gens]) for i in range(layers)]
        if self.cache:
            for mine, new in zip(self.cache, merged, strict=True):
                mine.extend(new)
        else:
            self.cache = merged
        for g in gens:
            g.cache = []  # the batch holds the row's K/V until it leaves
            self.gens.append(g)

    def leave(self, gen: Generation) -> None:
        """Give a row its own cache back and drop it from the batch."""
        slot = next(i for i, g in enumerate(self.gens) if g is gen)
        own = []
        step = kvcache.bucket_of(self.target)
        for c in self.cache:
            own.append(kvcache.own_layer(c.extract(slot), step))
        gen.cache = own
        del self.gens[slot]
        if not self.gens:
            self.cache = []
            return
        keep = [i for i in range(len(self.gens) + 1) if i != slot]
        for c in self.cache:
            c.filter(mx.array(keep))

    def round(self) -> list[Committed]:
        """One round for every row: drafts, one verify forward, per-row acceptance and trim."""
        gens = self.gens
        wants = [g.draft_length() for g in gens]
        ks = plan_widths(gens, wants, self.costs) if any(wants) else wants
        drafts = [g.propose(k) for g, k in zip(gens, ks, strict=True)]
        width = 1 + max(d.count for d in drafts)
        rows = []
        for g, d in zip(gens, drafts, strict=True):
            pending = mx.array([g.tokens[-1]], dtype=mx.uint32)
            pad = mx.full((width - 1 - d.count,), g.tokens[-1], dtype=mx.uint32)
            rows.append(mx.concatenate([pending, d.tokens.astype(mx.uint32), pad]))
        with selecting([g.target for g in gens]):  # each row on its own adapter (or none)
            logits = self.target(mx.stack(rows), cache=self.cache)
        walks = [g.walk(d, logits) for g, d in zip(gens, drafts, strict=True)]  # grammar rows
        chosen, hosts = [], []
        for i, (g, d) in enumerate(zip(gens, drafts, strict=True)):
            host = to_ints(d.tokens) if d.count and g.opts.has_penalties else []
            hosts.append(host)
            w = walks[i]
            bias = w.bias if w is not None else None
            chosen.append(choices(logits[i, : 1 + d.count], host, g.tokens, g.opts, g.rng, bias))
        mx.eval(chosen, [d.tokens for d in drafts])  # one host sync for the whole batch
        verdicts = [
            decide(to_ints(d.tokens) if d.count else [], to_ints(c))
            for d, c in zip(drafts, chosen, strict=True)
        ]
        self.keep([1 + v.accepted for v in verdicts], width)
        return [
            Committed(g, g.absorb(d, v, w, logits[i]))
            for i, (g, d, v, w) in enumerate(zip(gens, drafts, verdicts, walks, strict=True))
        ]

    def keep(self, kept: list[int], width: int) -> None:
        """After a `width`-token forward, keep `kept[i]` of row i's new positions: what every
        row dropped is trimmed off the end, the rest rolled into each row's left padding."""
        extra = [width - k for k in kept]
        common = min(extra)
        rest = [e - common for e in extra]
        for c in self.cache:
            if common:
                c.trim(common)
            if any(rest):
                c.prepare(right_padding=rest)
                c.finalize()
        if any(rest):
            self._compact()

    def _compact(self) -> None:
        """Cut the padding every row has on its left once it is worth a copy."""
        left = min(to_ints(self.cache[0].left_padding))
        if left >= COMPACT:
            for c in self.cache:
                c.filter(mx.arange(len(self.gens)))


def warm_rounds(target: nn.Module, rows: int, widths: int) -> None:
    """Run a batch of `rows` through every round width up to `widths`, with rows keeping
    different lengths (the roll), then let them leave: the shapes a GPU compiles once."""
    greedy = parse_options({"temperature": 0})
    gens = [Generation(target, [0, 0, 0], greedy, set(), 4, Rng(0)) for _ in range(rows)]
    for g in gens:
        g.prefill()
    batch = RowBatch(target, Costs(verify={1: 1.0}))
    batch.join(gens)
    for width in range(1, widths + 1):
        mx.eval(target(mx.zeros((rows, width), dtype=mx.uint32), cache=batch.cache))
        batch.keep([1] + [0] * (rows - 1), width)
        mx.eval([c.state for c in batch.cache])
    while len(batch):
        batch.leave(batch.gens[-1])
