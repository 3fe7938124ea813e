"""LoRA / DoRA applied unfused and chosen per row, so rows of different adapters share a forward.

Every projection an adapter touches is wrapped once (`RowLoRA`): the base layer stays as it
was, and beside it sit the mounted adapters' A (in, r) and s·B (r, out), stacked in the order of
their *slots* and nothing else (no zeros for "no adapter" or for a dropped adapter's slot: the
stacks are the adapters' own bytes). Before a forward the caller names each row's slot
(`Selection.set`); the layer computes

    y = base(x) + (x @ A[slot]) @ sB[slot]                         (LoRA, as mlx-lm's LoRALinear)
    y = (x W^T + (x @ A[slot]) @ sB[slot]) * ratio[slot] + bias     (DoRA)

for rows whose adapter the layer holds, and base(x) for the others. A plan numbers a row's
matrices by their place in the stacks from 1, 0 being "none" (what `lora_cuda`'s kernels read);
the `gather_mm`s take those places from 0 and zero the rows of none (`Plan.none`).

Each array operation costs about as much as the small matmuls of a low-rank term, so the layer
spends as few as it can: the scale s is folded into B once, at mount; the per-row slot indices
are built once per forward for all layers (`Selection.plan`), not per layer; rows of several
adapters take two `gather_mm`s, which pick each row's matrices without copying them (on a GPU,
rows of several tokens take x A for the held adapters side by side in one matmul, those the
rows use where they are few, and keep their own columns, then one `gather_mm`); and a layer
none of the rows' adapters touches is the base layer. On a CPU, where every operation and every Python step of a small model's decode shows,
a float32 forward takes `RowLoRA._direct`: no routing, the base multiplied by a transposed view
of its weight taken once (`nn.Linear` adds a transpose to each call), and rows that all use one
adapter on a layer (a lone row, a uniform batch) multiplied by its matrices directly, the sum
in the second matmul (`addmm`): three operations where the base takes one. On MLX's CUDA build
a float base decodes through `lora_cuda`'s kernels (the base matmuls and every row's terms of
the projections sharing an input, grouped by `_Group`, in one call: two kernels for a lone
row, the matmuls and one for several) and its stacks are held as A^T and B^T, whose rows those
kernels read; other GPU rows take the paths above, forwards of several tokens a row all on one
adapter (a prompt) its own matrices (`DIRECT_TOKENS`). Ranks are padded with zeros to a
multiple of 8 (exact): MLX's CUDA kernels fault on bf16 matrices of rank 4. DoRA's ratio
m / ||W + s B^T A^T|| is a constant of the adapter and the base, computed once at mount
(mlx-lm recomputes it, dequantizing W, on every call).

Stacks are rebuilt when an adapter is mounted or dropped (between forwards, on the pairing's
thread); slots stay where they are, so rows keep theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine import compiledstep, lora_cuda
from mlxd.engine.attention import cuda_available
from mlxd.engine.fewrows import FewRowsLinear
from mlxd.engine.fusedproj import SharedLinear
from mlxd.engine.smallarrays import kernel_array

__all__ = [
    "LayerWeights",
    "Plan",
    "RowLoRA",
    "Selection",
    "dora_ratio",
    "wrap",
    "wrap_for_decoding",
]

RANK_ALIGN = 8  # stacks' rank is a multiple of this (zero-padded; `lora_cuda` reads 8 at a time)
# On a GPU, forwards of this many tokens a row or more (a prompt, a verify round past the
# kernels) take no `gather_mm` for x A: rows all on one adapter multiply by its matrices, rows
# of several by theirs side by side (`_own_columns`). MLX's CUDA `gather_mm` takes a one-row
# kernel for single tokens, but for several it runs a tiled GEMM whose x A[slot], r columns
# wide, is one thread block walking all of K. An H100, the 7B-shaped bf16 target with
# 16 adapted blocks (`bench/lora_prompt.py`, whose `gathered` arm then took two `gather_mm`s):
# a 512-token prompt's forward took 17.5 ms this way and 577 ms gathered (the base: 13.1);
# 2,048 tokens 46.2 and 664 (37.9). Through `_own_columns`, rows of several adapters' route
# now, 37.3 and 103 ms
DIRECT_TOKENS = 2


@dataclass(frozen=True)
class Plan:
    """What one forward's rows ask of the layers holding a given set of slots."""

    single: int | None  # the slot every row uses on these layers, if they all use one
    picked: tuple[int, ...]  # each row's place in the stacks from 1, 0: its adapter is not held
    idx: mx.array  # (rows,) `picked` on the device (`kernel_array`)
    rows: mx.array  # arange(rows): the batch index of each row, for gather_mm
    places: mx.array  # (rows,) each row's place from 0 (a row of none: 0), for gather_mm
    none: mx.array | None  # (rows, 1, 1) True for rows of none, whose gathered term is zeroed;
    # None where every row has an adapter here
    _per_token: dict[int, mx.array] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def used(self) -> tuple[mx.array, mx.array]:
        """The places (from 0) of the adapters the rows use, each once, and each row's index
        into them (a row of none: 0, its term zeroed as in `places`)."""
        used = sorted({p - 1 for p in self.picked if p})
        index = {place: i for i, place in enumerate(used)}
        rows = [index.get(p - 1, 0) for p in self.picked]
        return kernel_array(used, mx.uint32), kernel_array(rows, mx.uint32)

    def token_slots(self, length: int) -> mx.array:
        """Each token's place in the stacks (from 1; 0: none) in a forward of `length`
        tokens per row."""
        if length == 1:
            return self.idx
        if length not in self._per_token:
            per_token = [s for s in self.picked for _ in range(length)]
            self._per_token[length] = kernel_array(per_token, mx.uint32)
        return self._per_token[length]


PlanKey = tuple[tuple[int, ...], frozenset[int], int]
MAX_PLANS = 256  # plans kept for later forwards on the same slots (a decoding row's steps)


@dataclass
class Selection:
    """Which slot each row of the next forward uses; None: every row is on the base."""

    slots: tuple[int, ...] | None = None
    _plans: dict[PlanKey, Plan | None] = field(default_factory=dict, repr=False)
    groups: dict[str, _Group] = field(default_factory=dict, repr=False)

    def set(self, slots: list[int]) -> None:
        """Rows past `slots` (padding) are on the base, unless one slot is named: then every
        row of the forward is on it."""
        self.slots = tuple(slots) if any(slots) else None
        self._forget()

    def clear(self) -> None:
        self.slots = None
        self._forget()

    def _forget(self) -> None:
        for group in self.groups.values():
            group.forget()

    def plan(self, held: frozenset[int], rows: int) -> Plan | None:
        """The plan for layers holding `held` slots in a forward of `rows` rows (None: no row
        uses any of them), shared by every such layer and kept for later forwards on the same
        slots: a decoding row's steps build its slot arrays once, not once per step."""
        slots = self.slots
        if slots is None:
            return None
        key = (slots, held, rows)
        if key in self._plans:
            return self._plans[key]
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        place = {slot: i + 1 for i, slot in enumerate(sorted(held))}  # as `RowLoRA._restack`
        own = [s if s in held else 0 for s in slots]
        if len(own) == 1:
            own *= rows
        else:
            own = (own + [0] * rows)[:rows]
        plan = None
        if any(own):
            picked = [place.get(s, 0) for s in own]
            single = own[0] if len(set(own)) == 1 else None
            plan = Plan(
                single,
                tuple(picked),
                kernel_array(picked, mx.uint32),
                kernel_array(range(rows), mx.uint32),
                kernel_array([max(p - 1, 0) for p in picked], mx.uint32),
                kernel_array([p == 0 for p in picked], mx.bool_)[:, None, None]
                if 0 in picked
                else None,
            )
        self._plans[key] = plan
        return plan


@dataclass(eq=False)
class _Group:
    """Projections of one input (a block's q, k and v; its gate and up): on the CUDA path one
    call computes the outputs of all of them on the same slots, for the first one called."""

    members: list[RowLoRA] = field(default_factory=list)
    nbytes: int = 0  # the members' base weights
    x: mx.array | None = None  # the input whose outputs `y` holds
    y: dict[int, mx.array] = field(default_factory=dict)  # id(member) -> its output, until taken
    # who computes with whom, by (caller, slots, input shape and dtype): a decoding row's
    # steps route alike, so they look it up rather than route every member again
    together: dict[tuple[Any, ...], list[tuple[RowLoRA, lora_cuda.Part]]] = field(
        default_factory=dict
    )

    def forget(self) -> None:
        self.x, self.y = None, {}

    def restacked(self) -> None:
        """A member's adapters changed: routes are decided anew."""
        self.together.clear()
        for member in self.members:
            member.forget_route()

    def members_with(
        self, member: RowLoRA, x: mx.array, part: lora_cuda.Part, idx: mx.array | None
    ) -> list[tuple[RowLoRA, lora_cuda.Part]]:
        """The members computed in `member`'s call for x (`member` first)."""
        key = (id(member), member.selection.slots, x.shape, x.dtype)
        together = self.together.get(key)
        if together is None:
            biased = part.bias is not None
            together = [(member, part)]
            for other in self.members:
                route = None if other is member else other.route(x)
                if route is not None and route[1] is idx and (route[0].bias is not None) == biased:
                    together.append((other, route[0]))
            if len(self.together) >= MAX_PLANS:
                self.together.clear()
            self.together[key] = together
        return together


def _fused_terms(
    x: mx.array, idx: mx.array, together: list[tuple[RowLoRA, lora_cuda.Part]]
) -> Callable[[mx.array], list[mx.array]] | None:
    """For several adapted rows of projections whose base is one fused matmul
    (`engine.fusedproj`): a call of that matmul, then every term in one launch; None where they
    are not such (or a lone row, whose `project` call launches fewer kernels)."""
    if x.shape[0] * x.shape[1] < lora_cuda.MATMUL_ROWS:
        return None
    bases = [m.base for m, _ in together]
    if not all(isinstance(b, SharedLinear) for b in bases):
        return None
    shared = bases[0].shared
    parts = [p for _, p in together]
    if any(b.shared is not shared for b in bases) or not lora_cuda.takes_terms(parts):
        return None
    members = [b.member for b in bases]
    terms = lora_cuda.terms_call(idx, parts, [shared.bounds[i][0] for i in members])

    def call(x: mx.array) -> list[mx.array]:
        y = shared.whole(x)
        shared.take(members)  # the others' columns wait for their call
        return terms(x, y)

    return call


# Projections sharing an input in mlx-lm's models, by name: grouped within their parent module.
GROUPED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}


@dataclass(frozen=True)
class LayerWeights:
    """One adapter's weights for one projection."""

    a: mx.array  # (in, r)
    b: mx.array  # (r, out)
    scale: float
    ratio: mx.array | None = None  # DoRA: (out,) m / ||W + s B^T A^T||
    # its own rank, aligned (`RANK_ALIGN`); 0 until mounted. Held as views of stacks padded to
    # the largest rank mounted beside it, it still restacks (and counts) at this one.
    rank: int = 0

    @property
    def nbytes(self) -> int:
        """What it holds at its own rank: A, B and a DoRA ratio, in the stacks' dtype."""
        d_in, d_out = self.a.shape[0], self.b.shape[1]
        ratio = d_out if self.ratio is not None else 0
        return ((d_in + d_out) * self.rank + ratio) * self.a.itemsize

    def folded(self) -> LayerWeights:
        """The same term with the scale folded into B (scale 1)."""
        if self.scale == 1.0:
            return self
        return replace(self, b=self.b * self.scale, scale=1.0)


@dataclass
class _Stacks:
    a: mx.array  # (adapters, in, r): the held adapters, in slot order
    b: mx.array  # (adapters, r, out), each one's scale folded in
    ratio: mx.array | None  # (adapters, out)
    held: frozenset[int]  # the slots holding an adapter
    direct: bool  # rows all on one adapter multiply by its matrices (CPU; a GPU's from
    # `DIRECT_TOKENS` tokens a row), not gathered
    fused: lora_cuda.Part | None = None  # decoding takes `lora_cuda`'s kernels: the stacks
    # held as A^T (adapters, r, in) and B^T (adapters, out, r), a and b their transposed views


@dataclass
class _Slots:
    """A plain holder (not module parameters: the base model's parameter tree stays the base's)."""

    by_slot: dict[int, LayerWeights] = field(default_factory=dict)
    stacks: _Stacks | None = None
    # on a CPU (float32, LoRA): the base's product, which `RowLoRA._direct` takes with the
    # slots' own views (None: the general path)
    base: Callable[[mx.array], mx.array] | None = None
    route: _Route | None = None  # the last adapted kernel route, for the next like forward


@dataclass(frozen=True)
class _Route:
    """An adapted projection's kernel call for inputs of one shape on one set of rows' slots,
    bound once: a decoding row's (or a batch's) every step routes alike, so it replays this
    rather than deciding the route and building the call's arguments again (host Python that a
    step's speed is bound by)."""

    slots: tuple[int, ...] | None  # `Selection.slots`
    shape: tuple[int, ...]
    dtype: mx.Dtype
    call: Callable[[mx.array], list[mx.array]]  # x -> the outputs of its group's members
    siblings: tuple[int, ...] = ()  # the other members whose outputs `call` also gives


def _route_of(
    slots: tuple[int, ...] | None,
    x: mx.array,
    part: lora_cuda.Part,
    idx: mx.array | None,
    together: list[tuple[RowLoRA, lora_cuda.Part]] | None,
) -> _Route:
    """The call for x's like: adapted rows of a fused gate and up their matmul and terms
    (`_fused_terms`), any other `lora_cuda.project` on the parts, bound."""
    if together is None:
        return _Route(slots, x.shape, x.dtype, lora_cuda.bound(idx, [part]))
    call = _fused_terms(x, idx, together) if idx is not None else None
    if call is None:
        call = lora_cuda.bound(idx, [p for _, p in together])
    return _Route(slots, x.shape, x.dtype, call, tuple(id(m) for m, _ in together[1:]))


def _base_weight(base: nn.Module) -> mx.array:
    """The base projection's weight as (out, in), dequantized where it is quantized."""
    if isinstance(base, nn.QuantizedLinear):
        return mx.dequantize(
            base.weight, base.scales, base.get("biases"), base.group_size, base.bits,
            mode=getattr(base, "mode", "affine"),
        )  # fmt: skip
    return base.weight


def _view(stack: mx.array, slot: int) -> mx.array:
    """`stack[slot]` sharing the stack's memory."""
    return stack[slot : slot + 1].squeeze(0)


def _on_gpu() -> bool:
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def _stack_dtype(base: nn.Module) -> mx.Dtype:
    """The dtype adapters' terms compute in beside `base`: the base's own (a quantized one: its
    scales') on a GPU; float32 on a CPU, whose `gather_mm` takes nothing else."""
    if not _on_gpu():
        return mx.float32
    return base.scales.dtype if isinstance(base, nn.QuantizedLinear) else base.weight.dtype


def _decodes_fused(base: nn.Module) -> bool:
    """Whether rows decoding on adapters of `base` take the CUDA kernels (a float projection on
    MLX's CUDA build); a quantized one keeps the MLX ops."""
    return (
        _on_gpu()
        and cuda_available()
        and type(base) in (nn.Linear, SharedLinear, FewRowsLinear)
        and lora_cuda.serves(base.weight)
    )


def _base_product(base: nn.Module) -> Callable[[mx.array], mx.array]:
    """x -> base(x) in as few array operations as the base allows: a float projection multiplies
    by a transposed view of its weight taken once (`nn.Linear` adds a transpose to every call;
    the view shares the weight's memory)."""
    if type(base) is not nn.Linear:
        return base
    wt = base.weight.T
    mx.eval(wt)
    if "bias" not in base:
        return lambda x: x @ wt
    bias = base.bias
    return lambda x: mx.addmm(bias, x, wt)


def _own_columns(x: mx.array, stacks: _Stacks, plan: Plan) -> mx.array:
    """x A[places[i]] for each row i of x (rows, length, in): one matmul by the A of every
    adapter the stacks hold side by side, then each row's r columns; where the rows use at
    most half of those adapters, by theirs alone (copied out of the stacks: many adapters of
    which a few are used would widen the product past the projection's own width)."""
    at, places = stacks.a.swapaxes(1, 2), plan.places  # (adapters, r, in): the kernels' own
    used, own = plan.used  # layout where they take the stacks, so side by side is a view
    if 2 * used.shape[0] <= at.shape[0]:
        at, places = mx.take(at, used, axis=0), own
    adapters, rank, d_in = at.shape
    every = x @ at.reshape(adapters * rank, d_in).T
    rows, length = x.shape[0], x.shape[1]
    every = every.reshape(rows, length, adapters, rank)
    picked = mx.take_along_axis(every, places.reshape(rows, 1, 1, 1), axis=2)
    return picked.reshape(rows, length, rank)


def dora_ratio(base: nn.Module, a: mx.array, b: mx.array, scale: float, m: mx.array) -> mx.array:
    """DoRA's per-output factor m / ||W + s B^T A^T||, as `DoRALinear` computes it each call."""
    w = _base_weight(base)
    adapted = w + (scale * b.T) @ a.T
    return m / mx.linalg.norm(adapted, axis=1)


class RowLoRA(nn.Module):
    """A base projection plus the mounted adapters' low-rank terms, selected per row."""

    def __init__(self, base: nn.Module, selection: Selection, group: _Group | None = None) -> None:
        super().__init__()
        self.base = base
        self.selection = selection
        self._slots = _Slots()
        self.group = group
        if group is not None:
            group.members.append(self)
            group.nbytes += base.weight.nbytes
        # decoding batches' rows on the base take the kernels too where they pay
        self.base_part = (
            lora_cuda.Part(None, base.weight, None, base.get("bias"))
            if _decodes_fused(base) and lora_cuda.batches_take_kernels()
            else None
        )

    @property
    def has_bias(self) -> bool:
        return "bias" in self.base

    @property
    def held(self) -> frozenset[int]:
        stacks = self._slots.stacks
        return stacks.held if stacks is not None else frozenset()

    @property
    def fused(self) -> lora_cuda.Part | None:
        """What the CUDA kernels read where decoding takes them, else None."""
        stacks = self._slots.stacks
        return stacks.fused if stacks is not None else None

    def put(self, slot: int, weights: LayerWeights | None) -> int:
        """Mount (or with None drop) one adapter's weights at `slot`, restacking; the bytes the
        slot now holds on this layer. The weights take the base's compute dtype on a GPU:
        mlx-lm's tuner saves float32, and float32 terms on a bf16 base add a cast of every
        input and every output to each projection (an H200 decoded a 7B-shaped bf16 base at a
        third of its speed that way)."""
        if weights is None:
            self._slots.by_slot.pop(slot, None)
        else:
            dtype = _stack_dtype(self.base)
            w = weights.folded()
            rank = -(-w.a.shape[1] // RANK_ALIGN) * RANK_ALIGN
            self._slots.by_slot[slot] = replace(
                w, a=w.a.astype(dtype), b=w.b.astype(dtype), rank=rank
            )
        self._restack()
        held = self._slots.by_slot.get(slot)
        return 0 if held is None else held.nbytes

    def forget_route(self) -> None:
        self._slots.route = None

    def _restack(self) -> None:
        self.forget_route()
        if self.group is not None:
            self.group.restacked()
        held = self._slots.by_slot
        if not held:
            self._slots.stacks = self._slots.base = None
            return
        order = sorted(held)  # the stacks' places, as `Selection.plan` numbers them
        size = len(order)
        rank = max(w.rank for w in held.values())  # the largest held now: stacks shrink too
        first = next(iter(held.values()))
        d_in, d_out = first.a.shape[0], first.b.shape[1]
        dora = any(w.ratio is not None for w in held.values())
        fused = not dora and _decodes_fused(self.base)
        # fused: held as A^T (adapters, r, in) and B^T (adapters, out, r), whose rows the
        # kernels read
        at = mx.zeros((size, rank, d_in), dtype=first.a.dtype)
        bt = mx.zeros((size, d_out, rank), dtype=first.b.dtype)
        ratio = mx.ones((size, d_out), dtype=at.dtype) if dora else None
        for i, slot in enumerate(order):
            w = held[slot]
            a, b = w.a[:, : w.rank], w.b[: w.rank, :]  # a view of wider stacks: its own part
            r = a.shape[1]
            at[i, :r, :] = a.T.astype(at.dtype)
            bt[i, :, :r] = b.T.astype(bt.dtype)
            if ratio is not None and w.ratio is not None:
                ratio[i] = w.ratio.astype(at.dtype)
        a, b = at.swapaxes(1, 2), bt.swapaxes(1, 2)
        if not fused:
            a, b = mx.contiguous(a), mx.contiguous(b)
        stacks = _Stacks(a, b, ratio, frozenset(held), direct=not _on_gpu())
        if fused:
            stacks.fused = lora_cuda.Part(at, self.base.weight, bt, self.base.get("bias"))
            together = len(self.group.members) if self.group is not None else 1
            for count in {1, together}:
                lora_cuda.warm(at.dtype, count, self.has_bias, term=True)
        mx.eval(stacks.a, stacks.b, *([ratio] if ratio is not None else []))
        self._slots.stacks = stacks
        for i, slot in enumerate(order):  # each adapter's weights become views of the stacks:
            # held once, not once more beside them (zero-padded to the stacks' rank). A range
            # slice shares the stacks' memory; an integer index (a gather) would copy it.
            held[slot] = replace(held[slot], a=_view(stacks.a, i), b=_view(stacks.b, i))
        mx.eval([(w.a, w.b) for w in held.values()])
        direct = stacks.direct and not dora and not fused
        self._slots.base = _base_product(self.base) if direct else None

    def _plan(self, x: mx.array) -> Plan | None:
        stacks = self._slots.stacks
        return None if stacks is None else self.selection.plan(stacks.held, x.shape[0])

    def route(self, x: mx.array) -> tuple[lora_cuda.Part, mx.array | None] | None:
        """What `lora_cuda.project` takes for this projection's input x: its part and each
        token's slot (None: every row on the base); None where MLX ops compute it."""
        return self._route(x, self._plan(x))

    def _route(
        self, x: mx.array, plan: Plan | None
    ) -> tuple[lora_cuda.Part, mx.array | None] | None:
        if plan is None:
            part = self.base_part
            if part is None or not lora_cuda.fits(x, part.weight.dtype, term=False):
                return None
            nbytes = part.weight.nbytes if self.group is None else self.group.nbytes
            return (part, None) if lora_cuda.pays(x.shape[0] * x.shape[1], nbytes) else None
        stacks = self._slots.stacks
        assert stacks is not None
        part = stacks.fused
        if part is None or not lora_cuda.fits(x, part.weight.dtype):
            return None
        return part, plan.token_slots(x.shape[1])

    def __call__(self, x: mx.array) -> mx.array:
        held = self._slots
        if held.base is not None and x.dtype == mx.float32:
            return self._direct(x, held)
        if self.selection.slots is None and self.base_part is None:
            return self.base(x)  # every row on the base, which takes no kernel: nothing to route
        if held.stacks is None and x.size == x.shape[-1]:
            return self.base(x)  # a lone row's step on the base: MLX's gemv, nothing to route
        group = self.group
        if group is not None and group.x is x and id(self) in group.y:
            return group.y.pop(id(self))  # computed with a sibling's, in its call
        known = held.route
        if (
            known is not None
            and known.slots == self.selection.slots
            and known.shape == x.shape
            and known.dtype == x.dtype
        ):
            return self._run(known, x)
        plan = self._plan(x)
        route = self._route(x, plan)
        if route is not None:
            part, idx = route
            together = None if group is None else group.members_with(self, x, part, idx)
            bound = _route_of(self.selection.slots, x, part, idx, together)
            if idx is not None and self.selection.slots is not None:  # adapted: kept
                held.route = bound
            return self._run(bound, x)
        if plan is None:
            return self.base(x)  # no row's adapter touches this projection
        stacks = self._slots.stacks
        assert stacks is not None
        if stacks.ratio is not None:
            return self._dora(x, stacks, plan)
        same = x.dtype == stacks.a.dtype
        if plan.single is not None and (stacks.direct or x.shape[1] >= DIRECT_TOKENS):
            w = self._slots.by_slot[plan.single]  # rows on one adapter: its matrices
            if same:
                return mx.addmm(self.base(x), x @ w.a, w.b)
            return self.base(x) + ((x @ w.a) @ w.b).astype(x.dtype)
        z = self._gathered(x, stacks, plan)
        return self.base(x) + (z if same else z.astype(x.dtype))

    def _run(self, route: _Route, x: mx.array) -> mx.array:
        """This projection's output by `route`; its siblings' wait in the group's `y`."""
        ys = route.call(x)
        if route.siblings:
            group = self.group
            assert group is not None
            if group.x is not x:
                group.x, group.y = x, {}
            group.y.update(zip(route.siblings, ys[1:], strict=True))
        return ys[0]

    def _direct(self, x: mx.array, held: _Slots) -> mx.array:
        """A CPU's forward, in the fewest array operations and Python steps: rows all on one
        adapter multiply by its matrices, the sum in the second matmul; rows of several take
        the `gather_mm`s."""
        assert held.base is not None and held.stacks is not None
        slots = self.selection.slots
        if slots is None:
            return held.base(x)
        plan = None
        if len(slots) == 1:  # every row on one slot (one this layer may not hold)
            single: int | None = slots[0]
        else:
            plan = self.selection.plan(held.stacks.held, x.shape[0])
            if plan is None:
                return held.base(x)
            single = plan.single
        if single is not None:
            w = held.by_slot.get(single)
            if w is None:
                return held.base(x)
            # as one matrix of rows x tokens: (rows, 1, r) @ (r, out) would be a batch of
            # `rows` products, each an operation of its own on a CPU
            flat = x.reshape(-1, x.shape[-1])
            y = mx.addmm(held.base(flat), flat @ w.a, w.b)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        assert plan is not None
        return held.base(x) + self._gathered(x, held.stacks, plan)

    @staticmethod
    def _gathered(x: mx.array, stacks: _Stacks, plan: Plan) -> mx.array:
        """Each row's (x A) sB, x being (rows, length, in), zero for rows of none: gather_mm
        picks each row's matrices by `plan.places`, no copies; on a GPU, rows of several
        tokens take their x A side by side instead (`_own_columns`, `DIRECT_TOKENS`)."""
        if x.shape[1] >= DIRECT_TOKENS and _on_gpu():
            h = _own_columns(x, stacks, plan)
        else:
            h = mx.gather_mm(x, stacks.a, plan.rows, plan.places)
        z = mx.gather_mm(h, stacks.b, plan.rows, plan.places)
        return z if plan.none is None else mx.where(plan.none, 0.0, z)

    def _dora(self, x: mx.array, stacks: _Stacks, plan: Plan) -> mx.array:
        assert stacks.ratio is not None
        lora = self._gathered(x, stacks, plan).astype(x.dtype)
        ratio = stacks.ratio[plan.places][:, None, :]
        if plan.none is not None:
            ratio = mx.where(plan.none, 1.0, ratio)
        y = (self._plain(x) + lora) * ratio.astype(x.dtype)
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
    family = GROUPED.get(name)
    group = None
    if family is not None:
        group = selection.groups.setdefault(f"{parent_path}:{family}", _Group())
    layer = RowLoRA(current, selection, group)
    setattr(parent, name, layer)
    compiledstep.forget(model)
    return layer


def wrap_for_decoding(model: nn.Module, selection: Selection) -> int:
    """Wrap, on MLX's CUDA build where `lora_cuda.batches_take_kernels`, the projections whose
    decoding batches' rows on the base take its kernels (those sharing an input in one call;
    o_proj alone; down_proj too where the tensor-core kernel reads its large W): the
    projections wrapped."""
    if not (_on_gpu() and cuda_available() and lora_cuda.batches_take_kernels()):
        return 0
    names = {*GROUPED, "o_proj", *(("down_proj",) if lora_cuda.mma_on() else ())}
    paths = [
        path
        for path, module in model.named_modules()
        if path.rpartition(".")[2] in names and type(module) in (nn.Linear, FewRowsLinear)
    ]
    layers = [wrap(model, path, selection) for path in paths]
    for layer in layers:
        part = layer.base_part
        if part is not None:
            count = len(layer.group.members) if layer.group is not None else 1
            lora_cuda.warm(part.weight.dtype, count, part.bias is not None, term=False)
    return len(layers)
