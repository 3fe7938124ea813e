"""KV caches whose multi-token forwards see recurring shapes.

mlx-lm's KVCache hands attention exactly `offset` keys, so a verify forward over k+1 tokens
lands on a new key length every round; on MLX's CUDA backend each new shape of a multi-token
attention costs a graph build (~40 ms), more than the round itself. This cache hands
multi-token forwards the whole allocated buffer (a multiple of `step`) with an explicit mask, so
shapes change only when the buffer grows. Single-token decoding keeps mlx-lm's exact path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll, make_prompt_cache

from mlxd.engine.sampling import to_ints
from mlxd.engine.smallarrays import MIN_BYTES

# Which layout a model's caches get is the backend's choice (`Backend.kv_bucket`): on a GPU a
# new attention shape costs a compile, so buckets are wide; on the CPU nothing compiles and
# attending over a padded buffer costs compute, so mlx-lm's exact caches serve there. The
# pairing marks each model it loads, and every cache made for that model (by generation,
# drafting, the scheduler, the prefix cache) follows the mark.
GPU_BUCKET = 1024
_MARK = "mlxd_kv_bucket"
# A prompt chunk at least this wide, starting where every chunk of a prompt read from the
# start begins (a multiple of `EXACT_ALIGN`), attends over exactly the keys it has with
# attention's causal fast path, as mlx-lm's prefill does: over the padded buffer with an
# explicit mask, attention materializes a chunk x buffer score matrix per head. Its key
# lengths (`EXACT_ALIGN` * i + width) still recur from prompt to prompt. 0 turns it off.
EXACT_MIN = 128
EXACT_ALIGN = 2048


def set_bucket(model: nn.Module, step: int | None) -> None:
    """Give `model`'s caches bucketed buffers of `step` keys, or (None) mlx-lm's exact ones."""
    setattr(model, _MARK, step)


def bucket_of(model: nn.Module | None) -> int | None:
    """The bucket `model`'s caches use; None for exact caches (and unmarked models)."""
    return getattr(model, _MARK, None)


class BucketedKVCache(KVCache):
    step = GPU_BUCKET
    batch: type[BucketedBatchKVCache]

    def _capacity_for(self, n: int) -> int:
        need = self.offset + n
        have = 0 if self.keys is None else int(self.keys.shape[2])
        if need <= have:
            return have
        return ((need + self.step - 1) // self.step) * self.step

    def _exact(self, n: int) -> bool:
        """Whether an `n`-token forward at this offset attends over exact keys (causal)."""
        return 0 < EXACT_MIN <= n and self.offset % EXACT_ALIGN == 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = int(keys.shape[2])
        exact = self._exact(n)
        capacity = self._capacity_for(n)
        if self.keys is None or capacity > self.keys.shape[2]:
            b, heads, _, k_dim = keys.shape
            v_dim = values.shape[3]
            new_k = mx.zeros((b, heads, capacity, k_dim), keys.dtype)
            new_v = mx.zeros((b, heads, capacity, v_dim), values.dtype)
            if self.keys is not None and self.values is not None and self.offset:
                new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
                new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
            self.keys, self.values = new_k, new_v
        buf_k, buf_v = self.keys, self.values
        assert buf_k is not None and buf_v is not None
        prev = self.offset
        self.offset += n
        buf_k[..., prev : self.offset, :] = keys
        buf_v[..., prev : self.offset, :] = values
        if n == 1 or exact:
            return buf_k[..., : self.offset, :], buf_v[..., : self.offset, :]
        return buf_k, buf_v

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n == 1:
            return None
        if self._exact(n):
            if not return_array:
                return "causal"
            rows = mx.arange(n)[:, None] + self.offset
            return mx.arange(self.offset + n)[None, :] <= rows
        capacity = self._capacity_for(n)
        rows = mx.arange(n)[:, None] + self.offset
        cols = mx.arange(capacity)[None, :]
        return cols <= rows

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """Rows joining a continuous batch keep the bucketed shapes."""
        return cls.batch.merge(caches)


def _roomy(values: mx.array, length: int = 0) -> mx.array:
    """`values` (rows,) in an array of at least `length` entries and MIN_BYTES, zeros after
    them: itself where it is that long already."""
    room = max(length, -(-MIN_BYTES // values.dtype.size))
    rows = int(values.shape[0])
    if rows >= room:
        return values
    return mx.concatenate([values, mx.zeros((room - rows,), values.dtype)])


class _RowValues:
    """A batch cache's per-row array (`offset`, `left_padding`), kept as a view of the first
    rows of a buffer of at least MIN_BYTES. MLX's CUDA allocator places every array of 8
    bytes or less, a kernel's output included, in one pool of managed memory (see
    `engine.smallarrays`): with one or two rows, each layer's offset update wrote there and
    its RoPE and attention read from there, every round."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        if cache is None:
            return self
        return cache.__dict__[self.name][1]

    def __set__(self, cache: Any, values: mx.array) -> None:
        _keep(cache, self.name, _roomy(values), int(values.shape[0]))


def _keep(cache: Any, name: str, buffer: mx.array, rows: int) -> None:
    cache.__dict__[name] = (buffer, buffer if buffer.shape[0] == rows else buffer[:rows])


def _shift(cache: Any, name: str, by: int | mx.array, down: bool = False) -> None:
    """Add `by` (a number, or an array as long as the buffer) to per-row array `name`, or
    subtract it (`down`), on its buffer: the result is as large as the buffer, so it stays
    out of the pool too."""
    buffer, view = cache.__dict__[name]
    _keep(cache, name, buffer - by if down else buffer + by, int(view.shape[0]))


def advance_rows(cache: BatchKVCache, n: int) -> None:
    """Move a batch cache's rows `n` positions on, as its own update does, for writes made
    outside it (a compiled step's)."""
    if isinstance(cache, BucketedBatchKVCache):
        _shift(cache, "offset", n)
    else:
        cache.offset += n
    cache._idx += n


class BucketedBatchKVCache(BatchKVCache):
    """The batch cache, handing attention its whole allocated buffer with a (B, 1, N, capacity)
    mask: batched decoding otherwise masks over a key length that changes every step.

    The buffer is always a whole number of buckets. mlx-lm's batch cache sizes it to the
    longest row when rows merge, grows it from the write position and cuts the rows' shared
    left padding when rows leave, so its length drifts to any number; on MLX's CUDA build a
    multi-token forward (a verify round, a draft catch-up) at a key length not seen before paid
    38-52 ms on the code pair (against 2-3 ms), and a 4 x 5 verify round served on the fat 7B
    pair once took 547 ms (against 12). Here rows merge into whole buckets, the buffer grows
    by whole buckets and a leaving row cuts only whole buckets of padding, so those forwards
    see the lengths warm-up ran."""

    step = GPU_BUCKET
    offset = _RowValues()
    left_padding = _RowValues()

    def _along(self, values: Sequence[int] | mx.array) -> mx.array:
        """Per-row `values` as long as the per-row buffers (zeros past the rows)."""
        length = int(self.__dict__["offset"][0].shape[0])
        if isinstance(values, mx.array):
            return _roomy(values, length)
        return mx.array([*values, *([0] * (length - len(values)))], dtype=mx.int32)

    def _whole(self, n: int) -> int:
        return -(-n // self.step) * self.step

    def _capacity_for(self, n: int) -> int:
        need = self._idx + n
        have = 0 if self.keys is None else int(self.keys.shape[2])
        return have if need <= have else self._whole(need)

    @classmethod
    def merge(cls, caches: Any) -> Any:
        if max(c.size() for c in caches) == 0:
            return cls([0] * len(caches))  # mlx-lm's would be its own (unbucketed) kind
        merged = super().merge(caches)
        if merged.keys is not None:
            merged._pad_to(merged._whole(merged.keys.shape[2]))
        return merged

    def _pad_to(self, capacity: int) -> None:
        """Zero positions appended to the buffer up to `capacity` keys."""
        assert self.keys is not None and self.values is not None
        extra = capacity - int(self.keys.shape[2])
        if extra > 0:
            widths = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, widths), mx.pad(self.values, widths)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self._idx, int(keys.shape[2])
        capacity = self._capacity_for(n)
        if self.keys is None:
            b, heads, _, k_dim = keys.shape
            # mlx-lm's __init__ leaves the buffers None, which its type stubs take as their type
            self.keys = mx.zeros((b, heads, capacity, k_dim), keys.dtype)  # type: ignore[assignment]
            self.values = mx.zeros((b, heads, capacity, values.shape[3]), values.dtype)  # type: ignore[assignment]
        else:
            self._pad_to(capacity)
        assert self.keys is not None and self.values is not None
        _shift(self, "offset", n)
        self._idx += n
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys, self.values

    def extract(self, idx: int, padding: int | None = None) -> KVCache:
        """Row `idx`'s K/V as its own cache; given its left `padding` (known to the caller),
        without reading the device (mlx-lm's reads the padding back, waiting for every queued
        forward)."""
        if padding is None:
            return super().extract(idx)
        assert self.keys is not None and self.values is not None
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, padding : self._idx])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, padding : self._idx])
        cache.offset = cache.keys.shape[2]
        return cache

    @staticmethod
    def drop_unread(layers: Sequence[BucketedBatchKVCache], dropped: mx.array) -> None:
        """Drop the last `dropped[i]` positions of row i in every layer, `dropped` being counts
        the host has not read (a verify round's rejected drafts, computed on the device):
        rolled into each row's left padding as `prepare(right_padding=...)` and `finalize`
        roll counts read. The layers hold the same positions, so the roll's order is computed
        once for all of them (per layer, a round would encode some 200 more operations on a
        28-layer model). Each layer keeps offsets and padding of its own: mlx-lm adds to them
        in place (`+=`), which would reach every layer sharing one array."""
        first = layers[0]
        assert first.keys is not None
        n = int(first.keys.shape[2])
        order = (mx.arange(n)[:, None] - dropped[:, None, None, None]) % n
        along = first._along(dropped)
        for layer in layers:
            assert layer.keys is not None and layer.values is not None
            layer.keys = mx.take_along_axis(layer.keys, order, axis=2)
            layer.values = mx.take_along_axis(layer.values, order, axis=2)
            _shift(layer, "offset", along, down=True)
            _shift(layer, "left_padding", along)

    def may_cut(self) -> bool:
        """Whether a whole bucket of left padding could be cut: the buffer holds more than one
        (left padding stays below the write position)."""
        return self.keys is not None and self.keys.shape[2] > self.step

    def filter(self, batch_indices: mx.array, min_left: int | None = None) -> None:
        """Keep the rows `batch_indices`, whole buckets of the least left padding among them
        cut off; given that padding (`min_left`, known to the caller), without reading the
        device, as `extract`."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        if min_left is None:
            if not self.may_cut():
                return  # no read
            min_left = min(to_ints(self.left_padding))
        cut = (min_left // self.step) * self.step
        if cut > 0:
            if self.keys is not None and self.values is not None:
                self.keys = self.keys[..., cut:, :]
                self.values = self.values[..., cut:, :]
            self._idx -= cut
            _shift(self, "left_padding", cut, down=True)

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        _shift(self, "offset", n, down=True)
        return n

    def prepare(self, *, right_padding: Sequence[int] | None = None, **kwargs: Any) -> None:
        """mlx-lm's, with right padding held as long as the per-row buffers (`finalize`)."""
        if kwargs:
            super().prepare(**kwargs)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = self._along(right_padding)  # type: ignore[assignment]

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is None:
            return
        rows = int(self.offset.shape[0])
        shift = padding[:rows, None]
        self.keys = dynamic_roll(self.keys, shift, axis=2)
        self.values = dynamic_roll(self.values, shift, axis=2)
        _shift(self, "offset", padding, down=True)
        _shift(self, "left_padding", padding)
        self._right_padding = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        n = N
        capacity = self._capacity_for(n)
        cols = mx.arange(capacity)[None, None, None, :]
        rows = (mx.arange(n) + self._idx)[None, None, :, None]
        left = mx.expand_dims(self.left_padding, (1, 2, 3))
        return (cols <= rows) & (cols >= left)


BucketedKVCache.batch = BucketedBatchKVCache


@functools.cache
def bucketed_type(step: int) -> type[BucketedKVCache]:
    """The bucketed cache class (and its batch class) for buckets of `step` keys."""
    if step == GPU_BUCKET:
        return BucketedKVCache
    batch = type(f"BucketedBatchKVCache{step}", (BucketedBatchKVCache,), {"step": step})
    return type(f"BucketedKVCache{step}", (BucketedKVCache,), {"step": step, "batch": batch})


def plain_kv(layer: Any) -> bool:
    """Whether a layer is a plain K/V cache (exact or bucketed): what a batch cache can hold."""
    return (
        type(layer) is KVCache
        or isinstance(layer, BucketedKVCache)
        or getattr(layer, "batchable_layer", False)  # a distributed target's shadow layer
    )


def batch_type(model: nn.Module) -> type[BatchKVCache]:
    """The batch cache class for rows of `model`, laid out as its own caches are."""
    own = getattr(model, "batch_cache_type", None)  # a distributed target's
    if own is not None:
        return own
    step = bucket_of(model)
    return bucketed_type(step).batch if step else BatchKVCache


def make_cache(model: nn.Module) -> list[Any]:
    """mlx-lm's cache for `model`, with plain KV layers bucketed where its mark says so."""
    step = bucket_of(model)
    return [new_kv_cache(step) if type(c) is KVCache else c for c in make_prompt_cache(model)]


def own_layer(part: KVCache, step: int | None) -> KVCache:
    """A row's own layer from what a batch cache's `extract` gave it (copied into the
    layout its model's caches use; a distributed target's shadow layer is already its own)."""
    if getattr(part, "adopt_as_is", False):
        return part
    layer = new_kv_cache(step)
    if part.keys is not None and part.offset:
        layer.update_and_fetch(part.keys, part.values)
    return layer


def new_kv_cache(step: int | None) -> KVCache:
    return bucketed_type(step)() if step else KVCache()
