"""The daemon's stand-in for a target sharded over a group of ranks.

It is called as mlx-lm models are (`target(tokens, cache=layers)`) and makes caches as they do
(`make_cache()`), so the engine's decoding, batching and speculation run unchanged. A forward
sends the cache journal and the tokens to rank 0, every rank runs its shard, and rank 0's
logits (every rank computes the full logits) come back as an `mx.array`; the shadow caches
then grow as the ranks' caches did. Forwards wider than `WIDE` tokens (wider than any verify
round: one pending token plus the most drafts a request may ask for) are prompt chunks, whose
callers read only the last position: only that position is sent back, the rest are zeros.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.engine.distributed.group import Group
from mlxd.engine.distributed.shadow import Journal, ShadowBatch, ShadowKV, restored, zeros
from mlxd.engine.distributed.worker import LAST_ONLY
from mlxd.registry.bounds import MAX_DRAFT_TOKENS
from mlxd.registry.distributed import Distribution

WIDE = 1 + MAX_DRAFT_TOKENS


class DistributedTarget:
    """A sharded target: forwards and cache operations run on every rank of its group."""

    batch_cache_type = ShadowBatch

    def __init__(self, name: str, model_dir: Path, dist: Distribution, float32: bool) -> None:
        self.group = Group(name, model_dir, dist, float32)
        self.journal = Journal()
        self.layers = [None]  # one shadow layer stands for each rank's whole list
        self.journal.sync = lambda: self.group.call(self.journal.take())
        weakref.finalize(self, self.group.close)

    @property
    def ranks(self) -> list[str]:
        return self.group.status.ranks

    def describe(self) -> list[str]:
        """The ranks for `ps`; once the group is lost, why, as a last line."""
        lost = self.group.lost
        if lost is None:
            return list(self.ranks)
        return [f"{r} (stopped)" for r in self.ranks] + [f"unavailable: {lost}"]

    def make_cache(self) -> list[Any]:
        return [ShadowKV(self.journal)]

    def restore_prefix(self, ns: Any, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """Caches holding the longest prefix of `tokens` that every rank has cached; (None, 0)
        when some rank has none of it."""
        sid = self.journal.new_id()
        ops = self.journal.take()
        ops.append(("restore", sid, tokens, (ns.model, ns.adapter, ns.kv)))
        held = int(self.group.call(ops) or 0)
        if held == 0:
            return None, 0
        return [restored(self.journal, sid, held)], held

    def close(self) -> None:
        self.group.close()

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **_: Any) -> mx.array:
        if cache is None or len(cache) != 1 or not hasattr(cache[0], "sid"):
            raise ValueError("a distributed target runs only on caches it made")
        layer = cache[0]
        tokens = np.array(inputs.astype(mx.uint32))
        if tokens.ndim == 1:
            tokens = tokens[None]
        batch, width = tokens.shape
        keep = LAST_ONLY if width > WIDE else "all"
        ops = self.journal.take()
        ops.append(("forward", layer.sid, tokens, keep))
        logits = self.group.call(ops)
        grow = zeros(batch, width)
        layer.update_and_fetch(grow, grow)
        out = mx.array(logits)
        if keep == LAST_ONLY:
            pad = mx.zeros((batch, width - 1, out.shape[-1]), dtype=out.dtype)
            out = mx.concatenate([pad, out], axis=1)
        return out
