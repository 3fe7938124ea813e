"""Forwards of a few tokens padded to a token count whose matrix kernels are cheaper.

A forward of n tokens (B rows of a batched decode round, or the L tokens of a verify) runs
every projection as one matrix product of n rows, and on MLX's CUDA build its cost is not
monotonic in n: one row runs a gemv, more rows a cuBLAS gemm whose kernels for a few rows are
slow. On an H200, an 8B bf16 forward of 2 to 6 tokens costs 1.5 decode steps and one of 8
tokens 1.0; a 4-bit one of 7 tokens 3.9 steps and one of 8 2.1 (Apple GPUs show the same kind
of cliff). So a product of n rows is run as one of m > n rows, zeros appended and the extra
rows dropped, wherever the forward of m tokens was measured cheaper than that of n (`plan`,
from the v(L) curve measured at probe-open). Only the projections are padded: attention and the
caches see the real rows, and each row's output is what it would be unpadded (rows of a matrix
product do not mix). Where the curve is monotonic, as on a CPU, nothing is padded.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.dequant import DequantizingLinear

MARGIN = 0.75  # pad only where the wider forward costs at most this share of the narrower
TIE = 1.05  # widths within this factor of the cheapest count as cheapest


def plan(verify: Mapping[int, float], margin: float = MARGIN) -> dict[int, int]:
    """Token count n -> the measured count m > n to pad it to: the cheapest measured forward
    wider than n, where it costs at most `margin` of the n-token one. Only measured counts
    are planned."""
    out = {}
    for n, cost in verify.items():
        wider = {m: c for m, c in verify.items() if m > n}
        if n < 2 or not wider:
            continue
        best = min(wider.values())
        fits = [m for m, c in wider.items() if c <= min(margin * cost, TIE * best)]
        if fits:
            out[n] = min(fits)  # the narrowest of the cheapest: less attention, less memory
    return out


def plan_both(verify: Mapping[int, float], rows: Mapping[int, float]) -> dict[int, int]:
    """The plan from both measured curves: n-token forwards of one row (`verify`: a verify's
    tokens) and n-row forwards of one token each (`rows`: a batched decode round). Their
    projections are the same n-row products, but their attention is not, so a cliff in the
    projections can show in one curve only (on an H200, rounds of 2 to 7 rows cost up to 1.7x
    one of 8 while one row's 2- to 8-token forwards cost alike); where both plan a count, the
    batch's curve decides."""
    return {**plan(verify), **plan(rows)}


def install(model: nn.Module, padded: Mapping[int, int]) -> int:
    """Pad `model`'s linear projections' row counts as `padded` says (an empty table takes
    the padding off); the number of projections changed. Each keeps its type's behaviour (it
    becomes a subclass), so code that recognises a projection by its type still does."""
    table = dict(padded)
    kinds: dict[type, type] = {}
    changed = 0
    for _, layer in model.named_modules():
        base = layer.base_kind if isinstance(layer, _Padded) else type(layer)
        if base not in (nn.Linear, nn.QuantizedLinear, DequantizingLinear):
            continue
        if not table:
            layer.__class__ = base
        else:
            if base not in kinds:
                name = f"RowPadded{base.__name__}"
                kinds[base] = type(name, (_Padded, base), {"pad_to": table, "base_kind": base})
            layer.__class__ = kinds[base]
        changed += 1
    return changed


def padding_of(model: nn.Module) -> dict[int, int]:
    """The table `install` gave `model`'s projections (empty when none)."""
    for _, layer in model.named_modules():
        if isinstance(layer, _Padded):
            return dict(layer.pad_to)
    return {}


class _Padded:
    """Mixed in ahead of a projection class: its call runs on `pad_to[n]` rows."""

    pad_to: dict[int, int]
    base_kind: type

    def __call__(self, x: mx.array) -> mx.array:
        width = x.shape[-1]
        n = x.size // width if width else 0
        m = self.pad_to.get(n)
        if m is None:
            return super().__call__(x)  # type: ignore[misc]
        rows = mx.pad(x.reshape(n, width), [(0, m - n), (0, 0)])
        y = super().__call__(rows)[:n]  # type: ignore[misc]
        return y.reshape(*x.shape[:-1], y.shape[-1])
