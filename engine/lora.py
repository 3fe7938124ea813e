"""LoRA / DoRA applied unfused and chosen per row, so rows of different adapters share a forward.

Every projection an adapter touches is wrapped once (`RowLoRA`): the base layer stays as it
was, and beside it sit each mounted adapter's A (in, r) and B (r, out) stacked by *slot*, slot 0
being "no adapter" (zeros). Before a forward the caller names each row's slot
(`Selection.rows`); the layer computes

    y = base(x) + scale[slot] * (x @ A[slot]) @ B[slot]          (LoRA, as mlx-lm's LoRALinear)
    y = (x W^T + scale[slot] * (x @ A[slot]) @ B[slot]) * ratio[slot] + bias          (DoRA)

with `gather_mm`, which picks each row's matrices without copying them (when every row of a
forward uses one adapter, as a lone row does, its matrices are used directly). DoRA's ratio
m / ||W + s B^T A^T|| is a constant of the adapter and the base, computed once at mount (mlx-lm
recomputes it, dequantizing W, on every call). With no row on an adapter (`rows` is None) the
layer is the base layer and costs nothing more.

Stacks are rebuilt when an adapter is mounted or dropped (between forwards, on the pairing's
thread); slots stay where they are, so rows keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["LayerWeights", "RowLoRA", "Selection", "dora_ratio", "wrap"]


@dataclass
class Selection:
    """Which slot each row of the next forward uses; None: every row is on the base."""

    rows: mx.array | None = None
    single: int | None = None  # the one slot every row uses, when they all use one

    def set(self, slots: list[int]) -> None:
        self.rows = mx.array(slots, dtype=mx.uint32) if any(slots) else None
        self.single = slots[0] if self.rows is not None and len(set(slots)) == 1 else None

    def clear(self) -> None:
        self.rows, self.single = None, None


@dataclass(frozen=True)
class LayerWeights:
    """One adapter's weights for one projection."""

    a: mx.array  # (in, r)
    b: mx.array  # (r, out)
    scale: float
    ratio: mx.array | None = None  # DoRA: (out,) m / ||W + s B^T A^T||


@dataclass
class _Stacks:
    a: mx.array
    b: mx.array
    scale: mx.array
    ratio: mx.array | None


@dataclass
class _Slots:
    """A plain holder (not module parameters: the base model's parameter tree stays the base's)."""

    by_slot: dict[int, LayerWeights] = field(default_factory=dict)
    stacks: _Stacks | None = None


def _base_weight(base: nn.Module) -> mx.array:
    """The base projection's weight as (out, in), dequantized where it is quantized."""
    if isinstance(base, nn.QuantizedLinear):
        return mx.dequantize(
            base.weight, base.scales, base.get("biases"), base.group_size, base.bits,
            mode=getattr(base, "mode", "affine"),
        )  # fmt: skip
    return base.weight


def dora_ratio(base: nn.Module, a: mx.array, b: mx.array, scale: float, m: mx.array) -> mx.array:
    """DoRA's per-output factor m / ||W + s B^T A^T||, as `DoRALinear` computes it each call."""
    w = _base_weight(base)
    adapted = w + (scale * b.T) @ a.T
    return m / mx.linalg.norm(adapted, axis=1)


class RowLoRA(nn.Module):
    """A base projection plus the mounted adapters' low-rank terms, selected per row."""

    def __init__(self, base: nn.Module, selection: Selection) -> None:
        super().__init__()
        self.base = base
        self._selection = selection
        self._slots = _Slots()

    @property
    def has_bias(self) -> bool:
        return "bias" in self.base

    def put(self, slot: int, weights: LayerWeights | None) -> None:
        """Mount (or with None drop) one adapter's weights at `slot`; restacks."""
        if weights is None:
            self._slots.by_slot.pop(slot, None)
        else:
            self._slots.by_slot[slot] = weights
        self._restack()

    def _restack(self) -> None:
        held = self._slots.by_slot
        if not held:
            self._slots.stacks = None
            return
        size = max(held) + 1
        rank = max(w.a.shape[1] for w in held.values())
        first = next(iter(held.values()))
        d_in, d_out = first.a.shape[0], first.b.shape[1]
        a = mx.zeros((size, d_in, rank), dtype=first.a.dtype)
        b = mx.zeros((size, rank, d_out), dtype=first.b.dtype)
        scale = [0.0] * size
        dora = any(w.ratio is not None for w in held.values())
        ratio = mx.ones((size, d_out), dtype=mx.float32) if dora else None
        for slot, w in held.items():
            r = w.a.shape[1]
            a[slot, :, :r] = w.a.astype(a.dtype)
            b[slot, :r, :] = w.b.astype(b.dtype)
            scale[slot] = w.scale
            if ratio is not None and w.ratio is not None:
                ratio[slot] = w.ratio.astype(mx.float32)
        stacks = _Stacks(a, b, mx.array(scale, dtype=mx.float32), ratio)
        mx.eval(stacks.a, stacks.b, stacks.scale, *([ratio] if ratio is not None else []))
        self._slots.stacks = stacks
        for slot, w in held.items():  # each adapter's weights become views of the stacks:
            r = w.a.shape[1]  # held once, not once more beside them
            held[slot] = replace(w, a=stacks.a[slot, :, :r], b=stacks.b[slot, :r, :])
        mx.eval([(w.a, w.b) for w in held.values()])  # slices share the stacks' memory

    def __call__(self, x: mx.array) -> mx.array:
        rows = self._selection.rows
        stacks = self._slots.stacks
        if rows is None or stacks is None:
            return self.base(x)
        size = stacks.a.shape[0]
        single = self._selection.single
        if single is not None and stacks.ratio is None:
            w = self._slots.by_slot.get(single)
            if w is None:
                return self.base(x)  # this adapter does not touch this projection
            # one adapter for every row (a lone row): y + s * (x A) B in one fused kernel
            return mx.addmm(self.base(x), x @ w.a, w.b, alpha=w.scale)
        idx = mx.where(rows < size, rows, mx.zeros_like(rows))  # a slot not on this layer: 0
        if idx.shape[0] not in (1, x.shape[0]):  # rows padded in after the selected ones: base
            idx = mx.concatenate([idx, mx.zeros((x.shape[0] - idx.shape[0],), dtype=idx.dtype)])
        # x is (rows, length, in): gather_mm picks each row's matrices by `idx`, no copies
        z = mx.gather_mm(mx.gather_mm(x, stacks.a, rhs_indices=idx), stacks.b, rhs_indices=idx)
        lora = (stacks.scale[idx][:, None, None] * z).astype(x.dtype)
        if stacks.ratio is None:
            return self.base(x) + lora
        y = self._plain(x) + lora
        y = stacks.ratio[idx][:, None, :].astype(x.dtype) * y
        if self.has_bias:
            y = y + self.base.bias
        return y

    def _plain(self, x: mx.array) -> mx.array:
        """The base projection without its bias (DoRA scales that part only)."""
        base = self.base
        if not self.has_bias:
            return base(x)
        if isinstance(base, nn.QuantizedLinear):
            return mx.quantized_matmul(
                x, base.weight, base.scales, base.get("biases"), transpose=True,
                group_size=base.group_size, bits=base.bits, mode=getattr(base, "mode", "affine"),
            )  # fmt: skip
        return x @ base.weight.T


def wrap(model: nn.Module, path: str, selection: Selection) -> RowLoRA:
    """The `RowLoRA` at module `path` of `model`, wrapping the projection there on first use."""
    parent_path, _, name = path.rpartition(".")
    parent: Any = model
    for part in parent_path.split(".") if parent_path else []:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    current = getattr(parent, name)
    if isinstance(current, RowLoRA):
        return current
    if not isinstance(current, nn.Linear | nn.QuantizedLinear):
        raise TypeError(f"{path} is a {type(current).__name__}, not a linear projection")
    layer = RowLoRA(current, selection)
    setattr(parent, name, layer)
    return layer
