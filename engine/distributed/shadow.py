"""The daemon's side of a sharded target's caches: metadata twins that journal what is done.

The engine reads and changes caches freely (offsets, left padding, trims, a batch's merge,
extend, extract, filter, roll). On the daemon each cache list of the sharded target is ONE
shadow layer: a real mlx-lm cache whose K/V are one float wide, so mlx-lm's own code keeps its
offsets and padding exact at no cost, and every operation is appended to the group's journal
keyed by the shadow's id. Each rank replays the journal on its own list of real layers (the
rank's own count: pipeline ranks hold different layers), applying every operation to each
layer, which is what the engine does to every layer of a list anyway.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

Op = tuple[Any, ...]


class Journal:
    """Cache operations not yet sent to the ranks, in the order the engine did them."""

    def __init__(self) -> None:
        self.sync: Callable[[], Any] = lambda: None  # sends what is journaled (the target's)
        self._ops: list[Op] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, *op: Any) -> None:
        with self._lock:
            self._ops.append(op)

    def take(self) -> list[Op]:
        with self._lock:
            ops, self._ops = self._ops, []
        return ops


def _plain(value: Any) -> Any:
    """An argument as plain Python (mx arrays become lists) for pickling."""
    if isinstance(value, mx.array):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class _Shadow:
    journal: Journal
    sid: int
    # a row's layer taken out of a batch is already the row's own (no copy into a new layer)
    adopt_as_is = True
    # rows may share a batch cache, though prompts are never read in one forward (feed_rows)
    batchable_layer = True

    def _register(self, journal: Journal, *created: Any, sid: int | None = None) -> None:
        self.journal = journal
        self.sid = journal.new_id() if sid is None else sid
        if created:
            journal.add(*created, self.sid)
        weakref.finalize(self, journal.add, "drop", self.sid)

    def offer_remote(self, ns: Any, tokens: list[int]) -> int:
        """Have every rank store its shard of what this layer holds of `tokens` (under the
        namespace's fields plus its split and rank); the tokens offered."""
        self.journal.add("offer", self.sid, tokens, (ns.model, ns.adapter, ns.kv))
        self.journal.sync()
        held = getattr(self, "offset", 0)
        return min(len(tokens), held if isinstance(held, int) else 0)


def zeros(batch: int, n: int) -> mx.array:
    return mx.zeros((batch, 1, n, 1), dtype=mx.float32)


class ShadowKV(_Shadow, KVCache):
    def __init__(self, journal: Journal | None = None, announce: bool = True) -> None:
        KVCache.__init__(self)
        if journal is not None and announce:
            self._register(journal, "new")

    def trim(self, n: int) -> int:
        self.journal.add("call", self.sid, "trim", [n], {})
        return int(KVCache.trim(self, n))


def restored(journal: Journal, sid: int, tokens: int) -> ShadowKV:
    """The shadow of caches the ranks restored from their prefix caches as `sid`."""
    layer = ShadowKV()
    layer.keys = layer.values = zeros(1, tokens)
    layer.offset = tokens
    layer._register(journal, sid=sid)
    return layer


class ShadowBatch(_Shadow, BatchKVCache):
    def __init__(self, left_padding: list[int]) -> None:
        BatchKVCache.__init__(self, left_padding)

    @classmethod
    def merge(cls, caches: Any) -> ShadowBatch:
        journal = caches[0].journal
        merged = BatchKVCache.merge.__func__(cls, caches)  # type: ignore[attr-defined]
        if not isinstance(merged, ShadowBatch):  # mlx-lm's empty case builds its own class
            merged = cls([0] * len(caches))
        merged._register(journal, "merge", [c.sid for c in caches])
        return merged

    def extract(self, idx: int) -> ShadowKV:
        part = BatchKVCache.extract(self, idx)
        row = ShadowKV()
        row.keys, row.values, row.offset = part.keys, part.values, part.offset
        row._register(self.journal, "extract", self.sid, idx)
        return row

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        plain = {k: _plain(v) for k, v in kwargs.items()}
        self.journal.add("call", self.sid, name, [_plain(a) for a in args], plain)

    def trim(self, n: int) -> int:
        self._call("trim", n)
        return int(BatchKVCache.trim(self, n))

    def filter(self, batch_indices: Any) -> None:
        self._call("filter", batch_indices)
        BatchKVCache.filter(self, batch_indices)

    def extend(self, other: Any) -> None:
        self.journal.add("extend", self.sid, other.sid)
        BatchKVCache.extend(self, other)

    def prepare(self, **kwargs: Any) -> None:
        self._call("prepare", **kwargs)
        BatchKVCache.prepare(self, **kwargs)

    def finalize(self) -> None:
        self._call("finalize")
        BatchKVCache.finalize(self)
