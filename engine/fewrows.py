"""A lone row's forwards of a few tokens (a verify round) on mlxd's tensor-core kernel (CUDA).

On MLX's CUDA build a forward is bound by the host's encoding of its operations, and a matmul
of one row (a decode step: MLX's gemv) encodes in about 7 us where one of 2-32 rows goes to
cuBLAS, which builds its descriptors and asks for an algorithm on every call: 16-19 us. A verify
round's forward on a 7B-shaped bf16 model (28 blocks, 196 projections) therefore encoded in
8.6 ms at 2 to 16 tokens against 3.1 ms for one token, on an H200: 3.9 ms of it the projections
(1.7 at one token). `mma_cuda`'s kernel encodes in 6-8 us and computes the projections of one
input in one launch (a block's q, k and v; its gate and up), so a block's seven cuBLAS calls
become four launches.

At load, where MLX runs on CUDA and a block's projections are float (bf16 or fp16) and plain
`nn.Linear`s, each becomes a `FewRowsLinear` of its group: one input's projections; where they
are 4-bit (MLX's affine quantization), a `FewRowsQuantizedLinear` on `qmma_cuda`'s kernel,
which reads the packed weights once for all of a forward's tokens where MLX's reads them once
per token (a 7B-shaped 4-bit target's 8-token forward: 0.98 of a one-token one against 2.58,
on an H100). A forward of one row and 2-32 tokens (`mma_cuda.MAX_ROWS`) computes the group's
outputs in the first member's call; its siblings take theirs. Anything else (a decode step,
batches, prompts) keeps the layer's own matmul. The layers keep their weights (no copies) and
stay `nn.Linear`s (`nn.QuantizedLinear`s), so adapters (`engine.lora`) wrap them as they wrap
any projection. `MLXD_FEW_ROWS=0` turns it off;
`MLXD_FEW_ROWS=batches` also sends a batch's forwards of 2 tokens or more a row (its verify
rounds, prompts read as rows) up to 32 rows x tokens; it stays opt-in until a served A/B on one
machine start decides it (plain batch rounds on this kernel ran slower served, for a reason not
traced: `lora_cuda`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine import mma_cuda, qmma_cuda

__all__ = ["FewRowsLinear", "FewRowsQuantizedLinear", "group_projections", "install"]

MIN_TOKENS = 2  # one token is MLX's gemv, cheaper to encode than any other route
# projections of one input, by name, in mlx-lm's models: grouped within their parent module
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))

# x, the group's weights (float arrays, or `qmma_cuda.Quantized` parts), their biases
Matmul = Callable[[mx.array, Sequence[Any], Sequence[mx.array] | None], list[mx.array]]
# the same for quantized weights of one group size: (x, parts, biases, group_size)
QuantizedMatmul = Callable[
    [mx.array, Sequence[qmma_cuda.Quantized], Sequence[mx.array] | None, int], list[mx.array]
]


@dataclass(eq=False)
class _Group:
    """One input's projections: their weights (and biases), and outputs waiting to be taken."""

    weights: list[Any]
    biases: list[mx.array] | None
    matmul: Matmul
    max_tokens: int  # rows x tokens of a forward the group computes together
    dtype: mx.Dtype  # x's, for the kernel: the weights' (a quantized group: its scales')
    width: int  # x's last axis (K)
    batches: bool = False  # forwards of several rows too (else one row's only)
    min_tokens: int = MIN_TOKENS  # the fewest tokens a row of a forward the group computes
    x: mx.array | None = None
    waiting: dict[int, mx.array] = field(default_factory=dict)

    def takes(self, x: mx.array) -> bool:
        """Whether x is a forward the group computes: a lone row's (or, with `batches`, a
        batch's) of `min_tokens` to `max_tokens` rows x tokens, in the group's dtype."""
        return (
            x.ndim == 3
            and (x.shape[0] == 1 or self.batches)
            and x.shape[1] >= self.min_tokens
            and x.shape[0] * x.shape[1] <= self.max_tokens
            and x.dtype == self.dtype
        )

    def output(self, member: int, x: mx.array) -> mx.array:
        """Member `member`'s output for x: waiting since a sibling's call on this x, else
        computed now with every member's."""
        if self.x is not x or member not in self.waiting:
            ys = self.matmul(x, self.weights, self.biases)
            self.x, self.waiting = x, dict(enumerate(ys))
        y = self.waiting.pop(member)
        if not self.waiting:
            self.x = None
        return y


class FewRowsLinear(nn.Linear):
    """A float projection whose one-row forwards of a few tokens compute with its group's."""

    def __init__(self, base: nn.Linear, group: _Group, member: int) -> None:
        nn.Module.__init__(self)
        self.weight = base.weight
        if "bias" in base:
            self.bias = base.bias
        self.group, self.member = group, member

    def __call__(self, x: mx.array) -> mx.array:
        if self.group.takes(x):
            return self.group.output(self.member, x)
        return super().__call__(x)


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """A quantized projection whose one-row forwards of a few tokens compute with its group's
    (still an `nn.QuantizedLinear`: adapters wrap it as they wrap any quantized base)."""

    def __init__(self, base: nn.QuantizedLinear, group: _Group, member: int) -> None:
        nn.Module.__init__(self)
        self.group_size, self.bits = base.group_size, base.bits
        self.mode = getattr(base, "mode", "affine")
        for name in ("weight", "scales", "biases", "bias"):
            if name in base:
                setattr(self, name, base[name])
        self.group, self.member = group, member
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        if self.group.takes(x):
            return self.group.output(self.member, x)
        return super().__call__(x)


def _groupable(layers: list[nn.Module]) -> bool:
    """Plain float projections of one input width and dtype, biased alike, K in 16-byte
    pieces (the kernel's loads)."""
    first = layers[0]
    return all(
        type(m) is nn.Linear
        and m.weight.dtype in (mx.bfloat16, mx.float16)
        and m.weight.dtype == first.weight.dtype
        and m.weight.shape[1] == first.weight.shape[1]
        and m.weight.shape[1] % 8 == 0
        and ("bias" in m) == ("bias" in first)
        for m in layers
    )


def _quantized_groupable(layers: list[nn.Module]) -> bool:
    """Affine 4-bit projections of one input width, group size and scales' dtype (2-byte
    floats), biased alike: `qmma_cuda`'s."""
    first = layers[0]
    return all(
        type(m) is nn.QuantizedLinear
        and getattr(m, "mode", "affine") == "affine"
        and "biases" in m
        and (m.group_size, m.bits) == (first.group_size, first.bits)
        and m.scales.dtype == first.scales.dtype
        and m.weight.shape[1] == first.weight.shape[1]
        and ("bias" in m) == ("bias" in first)
        and qmma_cuda.serves(m.weight, m.scales, m.group_size, m.bits)
        for m in layers
    )


def _bound(quantized: QuantizedMatmul, group_size: int) -> Matmul:
    def matmul(
        x: mx.array, parts: Sequence[Any], biases: Sequence[mx.array] | None
    ) -> list[mx.array]:
        return quantized(x, parts, biases, group_size)

    return matmul


def group_projections(
    model: nn.Module,
    matmul: Matmul,
    max_tokens: int,
    batches: bool = False,
    quantized: QuantizedMatmul | None = None,
) -> int:
    """Make every group of projections in `model` (`GROUPS`) whose layers qualify
    `FewRowsLinear`s computing through `matmul` (`batches`: a batch's forwards too), and with
    `quantized`, every group of 4-bit ones `FewRowsQuantizedLinear`s computing through it; the
    projections changed."""
    changed = 0
    for _, parent in model.named_modules():
        for names in GROUPS:
            if not all(name in parent for name in names):
                continue
            layers = [parent[name] for name in names]
            biases = [m.bias for m in layers] if "bias" in layers[0] else None
            if _groupable(layers):
                weight = layers[0].weight
                group = _Group(
                    [m.weight for m in layers], biases, matmul, max_tokens, weight.dtype,
                    weight.shape[1], batches,
                )  # fmt: skip
                wrap: type[FewRowsLinear] | type[FewRowsQuantizedLinear] = FewRowsLinear
            elif quantized is not None and _quantized_groupable(layers):
                first = layers[0]
                group = _Group(
                    [qmma_cuda.parts_of(m) for m in layers], biases,
                    _bound(quantized, first.group_size), max_tokens, first.scales.dtype,
                    first.weight.shape[1] * 32 // first.bits, batches,
                )  # fmt: skip
                wrap = FewRowsQuantizedLinear
            else:
                continue
            for i, (name, layer) in enumerate(zip(names, layers, strict=True)):
                setattr(parent, name, wrap(layer, group, i))
            changed += len(names)
    return changed


def install(model: nn.Module, batches: bool = False) -> int:
    """Group `model`'s projections onto `mma_cuda`'s kernel and its 4-bit ones onto
    `qmma_cuda`'s (MLX's CUDA build; `batches`: a batch's forwards too), and build the kernels
    for every tile count and group now, not in a request's first round."""

    def matmul(
        x: mx.array, weights: Sequence[mx.array], biases: Sequence[mx.array] | None
    ) -> list[mx.array]:
        return mma_cuda.matmul(x, weights, biases)

    most = min(mma_cuda.MAX_ROWS, qmma_cuda.MAX_ROWS)
    changed = group_projections(model, matmul, most, batches, qmma_cuda.matmul)
    warmed: set[tuple[Any, ...]] = set()
    for _, module in model.named_modules():
        if not isinstance(module, (FewRowsLinear, FewRowsQuantizedLinear)) or module.member:
            continue
        group = module.group
        key = (type(module), len(group.weights), group.biases is not None, group.dtype,
               group.width, getattr(module, "group_size", 0))  # fmt: skip
        if key in warmed:
            continue
        warmed.add(key)
        for tokens in range(8, most + 1, 8):  # every tile count
            x = mx.zeros((1, tokens, group.width), dtype=group.dtype)
            mx.eval(group.matmul(x, group.weights, group.biases))
    return changed
