"""Whether a model's K/V can be quantized (`kv_bits`), read from the caches it really makes.

MLX quantizes K and V along their last dimension in groups of `kv_group_size`, and mlx-lm's
sliding-window caches cannot be quantized at all. Config keys do not say every model's K/V
widths (multi-head latent attention, per-layer head sizes), so one token is run through a fresh
cache when the model loads and the widths are read off what it stored. A request the model
cannot take is then refused before it starts, never failed inside a step with MLX's message.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache

from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import OptionsError


@dataclass(frozen=True)
class KvLayout:
    """What quantizing a model's K/V depends on."""

    widths: tuple[int, ...] = ()  # distinct last dimensions of K and V in quantizable layers
    refusal: str | None = None  # why this model's K/V cannot be quantized at all

    def check(self, bits: int | None, group: int) -> None:
        """OptionsError (400) when `kv_bits`/`kv_group_size` cannot apply to this model."""
        if not bits:
            return
        if self.refusal is not None:
            raise OptionsError(f"kv_bits is not supported by this model: {self.refusal}")
        bad = [w for w in self.widths if w % group]
        if bad:
            sizes = ", ".join(str(w) for w in self.widths)
            raise OptionsError(
                f"kv_group_size {group} does not divide this model's head size ({sizes});"
                " use a group size that does, or no kv_bits"
            )


def kv_layout(model: nn.Module) -> KvLayout:
    """Run one token through a fresh cache of `model` (on an MLX thread) and read its layout."""
    cache = make_cache(model)
    try:
        mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=cache))
        if any(isinstance(c, RotatingKVCache) for c in cache):
            return KvLayout(refusal="its sliding-window attention layers keep K/V unquantized")
        widths: set[int] = set()
        for c in cache:
            keys, values = getattr(c, "keys", None), getattr(c, "values", None)
            if hasattr(c, "to_quantized") and keys is not None and values is not None:
                widths.update((int(keys.shape[-1]), int(values.shape[-1])))
        return KvLayout(tuple(sorted(widths)))
    finally:
        del cache
