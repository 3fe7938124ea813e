"""An MLP's gate and up projections as one matmul, on a GPU (opt-in: `MLXD_FUSE_MLP=1`).

A decode step of a 7B model on a GPU costs what its kernel launches cost the host, not what
the GPU spends: in-process on an H200, a 7B-shaped bf16 model's lone row decoded in 5.2 ms per
token with the gate and up projections as one matmul against 7.0 ms as two, and 8 rows in 7.7
against 9.7 ms (one machine start). Served, one run of `bench/concurrency.py` and
`bench/adapters.py` on another start did not show that gain, and a lone row on adapters decoded
at 0.59x the base's rate (against 0.89x unfused), a slowdown not yet understood: so it is off
unless asked for. Both projections read the same input, so at load each MLP's two weights (and
a quantized one's scales and biases) are concatenated into one, and each projection keeps a
view of its rows: whichever is called first computes both outputs, the other takes its own
waiting (`_Shared`), so the MLP's code, adapters (`engine.lora`) and anything reading a
projection's `weight` see the projections they always saw. Only a pair of the same kind (float,
or quantized alike) is fused; a projection called with another input computes its own rows.
q, k and v are left apart: their outputs are reshaped into heads, which copies a column slice
of a shared output (in-process, the same H200 decoded slower with them fused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["SharedLinear", "SharedQuantizedLinear", "fuse_gate_up"]


@dataclass(eq=False)
class _Shared:
    """The fused weights of projections of one input, and outputs waiting to be taken."""

    weight: mx.array  # (sum of outputs, in), the members' rows one after another
    bounds: list[tuple[int, int]]  # each member's rows
    bias: mx.array | None = None
    quant: dict[str, Any] | None = None  # scales, biases, group_size, bits, mode
    x: mx.array | None = None
    waiting: dict[int, mx.array] = field(default_factory=dict)

    def output(self, member: int, x: mx.array) -> mx.array:
        """Member `member`'s output for x: waiting since a sibling's call on this x, else
        computed now with every member's (theirs wait until called; a new input drops them)."""
        if self.x is not x or member not in self.waiting:
            self.whole(x)
        y = self.waiting.pop(member)
        if not self.waiting:
            self.x = None
        return y

    def whole(self, x: mx.array) -> mx.array:
        """Every member's output for x side by side, computed now; each member's columns wait
        for its call (`take` removes those a caller computes otherwise)."""
        y = self._matmul(x)
        self.x = x
        self.waiting = {i: y[..., a:b] for i, (a, b) in enumerate(self.bounds)}
        return y

    def take(self, members: list[int]) -> None:
        for i in members:
            self.waiting.pop(i, None)
        if not self.waiting:
            self.x = None

    def _matmul(self, x: mx.array) -> mx.array:
        q = self.quant
        if q is None:
            y = x @ self.weight.T
        else:
            y = mx.quantized_matmul(
                x, self.weight, scales=q["scales"], biases=q["biases"], transpose=True,
                group_size=q["group_size"], bits=q["bits"], mode=q["mode"],
            )  # fmt: skip
        return y if self.bias is None else y + self.bias


def _rows(a: mx.array | None, bounds: tuple[int, int]) -> mx.array | None:
    """Rows of a fused array as a view (a range slice shares its memory)."""
    return None if a is None else a[bounds[0] : bounds[1]]


class SharedLinear(nn.Linear):
    """A float projection whose output is a column range of a matmul shared with siblings."""

    def __init__(self, shared: _Shared, member: int) -> None:
        nn.Module.__init__(self)
        bounds = shared.bounds[member]
        self.weight = shared.weight[bounds[0] : bounds[1]]
        bias = _rows(shared.bias, bounds)
        if bias is not None:
            self.bias = bias
        self.shared, self.member = shared, member

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared.output(self.member, x)


class SharedQuantizedLinear(nn.QuantizedLinear):
    """The same for a quantized projection: its weight, scales and biases are row views."""

    def __init__(self, shared: _Shared, member: int, like: nn.QuantizedLinear) -> None:
        nn.Module.__init__(self)
        q = shared.quant
        assert q is not None
        bounds = shared.bounds[member]
        self.group_size, self.bits, self.mode = like.group_size, like.bits, q["mode"]
        self.weight = shared.weight[bounds[0] : bounds[1]]
        self.scales = q["scales"][bounds[0] : bounds[1]]
        if q["biases"] is not None:
            self.biases = q["biases"][bounds[0] : bounds[1]]
        bias = _rows(shared.bias, bounds)
        if bias is not None:
            self.bias = bias
        self.shared, self.member = shared, member
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared.output(self.member, x)


def _fusable(a: Any, b: Any) -> bool:
    """Two projections one matmul can compute: the same kind (exactly nn.Linear, or exactly
    nn.QuantizedLinear quantized alike), the same input width and dtype, biased alike."""
    if type(a) is not type(b) or type(a) not in (nn.Linear, nn.QuantizedLinear):
        return False
    if a.weight.shape[1] != b.weight.shape[1] or a.weight.dtype != b.weight.dtype:
        return False
    if ("bias" in a) != ("bias" in b):
        return False
    if isinstance(a, nn.QuantizedLinear):
        same = (a.group_size, a.bits, getattr(a, "mode", "affine"))
        return same == (b.group_size, b.bits, getattr(b, "mode", "affine")) and (
            ("biases" in a) == ("biases" in b)
        )
    return True


def _concat(arrays: list[mx.array | None]) -> mx.array | None:
    if arrays[0] is None:
        return None
    return mx.concatenate([a for a in arrays if a is not None], axis=0)


def _fuse(mlp: nn.Module) -> bool:
    gate, up = mlp.gate_proj, mlp.up_proj
    if not _fusable(gate, up):
        return False
    rows = [gate.weight.shape[0], up.weight.shape[0]]
    bounds = [(0, rows[0]), (rows[0], rows[0] + rows[1])]
    quant = None
    if isinstance(gate, nn.QuantizedLinear):
        quant = {
            "scales": _concat([gate.scales, up.scales]),
            "biases": _concat([gate.get("biases"), up.get("biases")]),
            "group_size": gate.group_size, "bits": gate.bits,
            "mode": getattr(gate, "mode", "affine"),
        }  # fmt: skip
    shared = _Shared(
        _concat([gate.weight, up.weight]),  # type: ignore[arg-type]
        bounds,
        _concat([gate.get("bias"), up.get("bias")]),
        quant,
    )
    arrays = [shared.weight, shared.bias]
    if quant is not None:
        arrays += [quant["scales"], quant["biases"]]
    mx.eval([a for a in arrays if a is not None])  # layer by layer: the originals go now
    if quant is None:
        mlp.gate_proj, mlp.up_proj = SharedLinear(shared, 0), SharedLinear(shared, 1)
    else:
        mlp.gate_proj = SharedQuantizedLinear(shared, 0, gate)
        mlp.up_proj = SharedQuantizedLinear(shared, 1, up)
    mx.eval(mlp.gate_proj.parameters(), mlp.up_proj.parameters())  # the views, not lazy slices
    return True


def fuse_gate_up(model: nn.Module) -> int:
    """Fuse every MLP's gate and up projections in `model` (modules holding both as
    `gate_proj` and `up_proj`); the number fused."""
    mlps = [m for _, m in model.named_modules() if "gate_proj" in m and "up_proj" in m]
    fused = sum(_fuse(mlp) for mlp in mlps)
    if fused:
        mx.clear_cache()  # the separate weights' memory goes back to the system
    return fused
