"""A draft model's forward over its own K/V caches, compiled once per buffer shape.

On MLX's CUDA build a small model's decode step is bound by the host: a 0.5B-shaped draft
step cost 3.25 ms on an H200 for 0.2 ms of weights, the host building 24 layers' graph in
Python and MLX encoding each of its operations. Compiled (`mx.compile`), the graph is traced
once and replayed, its elementwise chains fused. For the trace to recur, the forward sees only
shapes that recur: the caches' whole buffers (B, H, capacity, D), which hold positions
[0, offset) (a batch's rows from their left padding), and the write position as an array. It
writes its n positions with a dynamic `slice_update` and attends over the buffer through the
ragged decode kernel (one token on CUDA: keys [left, end) exactly) or under a mask; a new
trace is made only when a buffer grows. The caches stay mlx-lm's (exact or bucketed, lone or
batched), so every other forward (a prompt, a trim, a roll) uses them as before. A 7B-shaped
target gained nothing on an H100 (its host time is mostly MLX encoding operations), so only
drafts step this way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.engine.kvcache import BucketedBatchKVCache, BucketedKVCache, advance_rows
from mlxd.engine.smallarrays import kernel_array

_COMPILED = "mlxd_compiled_step"


class _Thread(threading.local):
    """What a compiled step holds per thread. MLX's streams are the thread's own: a lazy array
    made on one thread fails when evaluated on another ("no Stream(gpu, 0) in current thread";
    a zero bound made at import failed the daemon's probe thread so). Traces are kept per
    thread too, as their operations are made on the tracing thread's stream; a trace shared
    across threads ran on the CPU, not tried on a GPU."""

    def __init__(self) -> None:
        self.key = object()
        self.left: mx.array | None = None

    def zero_left(self) -> mx.array:
        """A lone row's first key (0), made on this thread."""
        if self.left is None:
            self.left = kernel_array([0], mx.int32)
            mx.eval(self.left)
        return self.left


_thread = _Thread()


class _Traces:
    """A model's compiled steps, one per thread (an attribute, not a module entry)."""

    def __init__(self) -> None:
        self.by_thread: dict[object, Callable[..., Any]] = {}


class TracedLayer:
    """A cache layer as the compiled forward sees it: whole buffers, the write position (`at`,
    (1,) int32; `end`: at + n), each row's RoPE position and first key (a batch's left
    padding) as arrays; nothing read on the host."""

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        pos: mx.array,
        rope: mx.array,
        left: mx.array,
    ) -> None:
        self.keys, self.values = keys, values
        self.at, self.offset = pos[0:1], rope
        # what the ragged decode kernel reads (`attention.route_module`): keys [left, end)
        self.ragged_left, self.ragged_end = left, pos[1:2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.at, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.at, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        cols = mx.arange(int(self.keys.shape[2]))[None, None, None, :]
        rows = (self.at + mx.arange(n))[None, None, :, None]
        return (cols <= rows) & (cols >= self.ragged_left[:, None, None, None])


def _forward(
    model: nn.Module, tokens: mx.array, pos: mx.array, rope: mx.array, left: mx.array, *kv: mx.array
) -> Any:
    layers = [TracedLayer(kv[i], kv[i + 1], pos, rope, left) for i in range(0, len(kv), 2)]
    logits = model(tokens, cache=layers)
    return (logits, *[b for layer in layers for b in (layer.keys, layer.values)])


def _compiled(model: nn.Module) -> Callable[..., Any] | None:
    """This thread's compiled step of `model` (its traces are kept per input shape); None for
    a model whose projections are wrapped per row (`forget`): their choices live on the
    host."""
    traces = getattr(model, _COMPILED, None)
    if traces is False:
        return None
    if traces is None:
        traces = _Traces()
        setattr(model, _COMPILED, traces)
    fn = traces.by_thread.get(_thread.key)
    if fn is None:

        def step(*args: mx.array) -> Any:
            return _forward(model, *args)

        fn = traces.by_thread[_thread.key] = mx.compile(step)
    return fn


def forget(model: nn.Module) -> None:
    """`model`'s modules change in ways a trace cannot see (adapters' row-wise projections):
    it is never stepped compiled again."""
    setattr(model, _COMPILED, False)


def enabled() -> bool:
    """Whether draft models step compiled (`MLXD_COMPILED_DRAFT=1`): a lone row's chain and a
    draft batch's steps and catch-ups."""
    flag = os.environ.get("MLXD_COMPILED_DRAFT", "")
    return flag.strip().lower() in ("1", "on", "true", "yes")


def _batch(layer: Any) -> bool:
    return isinstance(layer, BatchKVCache)


def _written(layer: Any) -> int:
    """Where the layer's next position goes: the shared write position of a batch's rows."""
    return int(layer._idx if _batch(layer) else layer.offset)


def steps(cache: Sequence[Any]) -> bool:
    """Whether `cache` can take a compiled step: plain K/V layers, a lone row's (exact or
    bucketed) or a batch's (mlx-lm's or bucketed, no right padding pending), at one write
    position, each holding a buffer already."""
    if not cache:
        return False
    first = cache[0]
    kind = type(first)
    for layer in cache:
        lone = type(layer) is KVCache or isinstance(layer, BucketedKVCache)
        batch = type(layer) is BatchKVCache or isinstance(layer, BucketedBatchKVCache)
        if not (lone or batch) or type(layer) is not kind or layer.keys is None:
            return False
        if batch and getattr(layer, "_right_padding", None) is not None:
            return False
        if _written(layer) != _written(first):
            return False
    return True


def _room(layer: Any, n: int) -> None:
    """Grow the layer's buffers by whole steps of its own when `n` more positions do not fit."""
    assert layer.keys is not None and layer.values is not None
    have, need = int(layer.keys.shape[2]), _written(layer) + n
    if need <= have:
        return
    step = int(getattr(layer, "step", 256))
    widths = [(0, 0), (0, 0), (0, -(-need // step) * step - have), (0, 0)]
    layer.keys, layer.values = mx.pad(layer.keys, widths), mx.pad(layer.values, widths)


def forward(model: nn.Module, cache: list[Any], tokens: mx.array, compiled: bool) -> mx.array:
    """`model(tokens, cache=cache)`'s logits (B, n, V), through the compiled step where
    `compiled` asks for it and the model and caches take it. Lazy: the caller evaluates."""
    fn = _compiled(model) if compiled and steps(cache) else None
    if fn is None:
        return model(tokens, cache=cache)
    n = int(tokens.shape[1])
    for layer in cache:
        _room(layer, n)
    first = cache[0]
    written = _written(first)
    pos = kernel_array([written, written + n], mx.int32)
    if _batch(first):
        rope, left = first.offset, first.left_padding
    else:
        rope, left = pos[0:1], _thread.zero_left()
    buffers: list[mx.array] = []
    for layer in cache:
        buffers += [layer.keys, layer.values]
        layer.keys = layer.values = None  # the step's own: its writes may reuse them in place
    out = fn(tokens, pos, rope, left, *buffers)
    del buffers
    for i, layer in enumerate(cache):
        layer.keys, layer.values = out[1 + 2 * i], out[2 + 2 * i]
        if _batch(layer):
            advance_rows(layer, n)
        else:
            layer.offset = written + n
    return out[0]
