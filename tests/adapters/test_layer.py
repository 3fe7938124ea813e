"""`RowLoRA` at one projection: every path it takes (one adapter for all rows, rows of several
adapters, rows on none) gives each row what mlx-lm's `LoRALinear` gives it, in the input's
dtype."""

from __future__ import annotations

import gc
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.tuner.lora import LoRALinear

from mlxd.engine.attention import cuda_available
from mlxd.engine.lora import LayerWeights, RowLoRA, Selection, _own_columns, _Stacks

D_IN, D_OUT = 32, 24


def adapter(seed: int, rank: int, scale: float) -> LayerWeights:
    """Float32 matrices, as mlx-lm's tuner saves them."""
    ka, kb = mx.random.split(mx.random.key(seed))
    a = 0.2 * mx.random.normal((D_IN, rank), key=ka)
    b = 0.2 * mx.random.normal((rank, D_OUT), key=kb)
    return LayerWeights(a, b, scale)


def reference(base: nn.Linear, w: LayerWeights, x: mx.array) -> mx.array:
    layer = LoRALinear.from_base(base, r=w.a.shape[1], scale=w.scale)
    layer.lora_a, layer.lora_b = w.a, w.b
    return layer(x)


@pytest.fixture(params=[mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def dtype(request: pytest.FixtureRequest) -> mx.Dtype:
    return request.param  # type: ignore[no-any-return]


def close(got: mx.array, want: mx.array) -> bool:
    """Float32 to rounding on a CPU; bf16 to a few ulps of the output's scale (on a GPU the
    layer computes the low-rank term in bf16, mlx-lm in the tuner's float32), and float32 so
    too on MLX's CUDA build, whose float32 matmuls round as TF32 (differences of 1e-3)."""
    assert got.dtype == want.dtype
    if got.dtype == mx.float32 and not cuda_available():
        return mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    scale = mx.abs(want.astype(mx.float32)).max().item()
    return mx.allclose(got, want, rtol=0.0, atol=1e-2 * scale).item()


def layer_with(dtype: mx.Dtype, *slots: tuple[int, LayerWeights]) -> tuple[RowLoRA, Selection]:
    base = nn.Linear(D_IN, D_OUT, bias=False)
    base.set_dtype(dtype)
    selection = Selection()
    layer = RowLoRA(base, selection)
    for slot, w in slots:
        layer.put(slot, w)
    return layer, selection


def run(layer: RowLoRA, selection: Selection, slots: list[int], x: mx.array) -> mx.array:
    selection.set(slots)
    try:
        return layer(x)
    finally:
        selection.clear()


def gathers_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Until `monkeypatch.undo()`: the default device reads as a GPU, and every `gather_mm`
    call appends to the list returned."""
    gathered = mx.gather_mm
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> mx.array:
        calls.append(1)
        return gathered(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mx, "gather_mm", counted)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    return calls


def test_one_adapter_for_every_row_is_mlx_lms_lora(dtype: mx.Dtype) -> None:
    one, two = adapter(1, 4, 10.0), adapter(2, 2, 2.5)
    layer, selection = layer_with(dtype, (1, one), (2, two))
    x = mx.random.normal((3, 5, D_IN), key=mx.random.key(3)).astype(dtype)
    want = reference(layer.base, one, x)
    assert close(run(layer, selection, [1], x), want)  # a lone view: every row on it
    assert close(run(layer, selection, [1, 1, 1], x), want)  # a uniform batch


def test_on_a_gpu_a_bf16_base_holds_its_adapters_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cast of inputs or outputs per projection, and half the bytes of the tuner's float32."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    base = nn.Linear(D_IN, D_OUT, bias=False)
    base.set_dtype(mx.bfloat16)
    layer = RowLoRA(base, Selection())
    held = layer.put(1, adapter(1, 8, 10.0))
    assert layer._slots.by_slot[1].a.dtype == layer._slots.by_slot[1].b.dtype == mx.bfloat16
    assert held == 2 * 8 * (D_IN + D_OUT)


def test_on_a_gpu_a_lone_row_gathers_single_tokens_and_multiplies_prompts_directly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU a lone row's single-token term is two `gather_mm`s (one-row kernels there;
    `addmm` and a plain matmul by an (in, r) matrix miss them); its prompt's, several tokens,
    is the adapter's own matrices (`gather_mm`'s GEMM walks K in one thread block for x A).
    Both give mlx-lm's result; ranks are padded to a multiple of 8 with zeros, which changes
    nothing."""
    one, two = adapter(1, 4, 10.0), adapter(2, 2, 2.5)
    x = mx.random.normal((1, 3, D_IN), key=mx.random.key(7))
    calls = gathers_on_a_gpu(monkeypatch)
    layer, selection = layer_with(mx.float32, (1, one), (2, two))
    stacks = layer._slots.stacks
    assert stacks is not None and stacks.a.shape[-1] == stacks.b.shape[-2] == 8
    token = run(layer, selection, [1], x[:, :1])
    assert len(calls) == 2
    prompt = run(layer, selection, [1], x)
    uniform = run(layer, selection, [1, 1], mx.concatenate([x, x]))
    monkeypatch.undo()
    assert len(calls) == 2
    assert close(token, reference(layer.base, one, x[:, :1]))
    assert close(prompt, reference(layer.base, one, x))
    assert close(uniform[1:], prompt)


def test_on_a_gpu_rows_of_several_tokens_take_x_a_as_one_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of several adapters (and none), several tokens each (a batch's verify round, a
    join): x A for every held adapter in one matmul, each row keeping its own columns, and one
    `gather_mm` for the sB side; every row gets its own adapter's output, a row of none the
    base's to the bit."""
    adapters = {1: adapter(1, 4, 10.0), 2: adapter(2, 2, 2.5), 3: adapter(3, 8, 1.0)}
    x = mx.random.normal((4, 5, D_IN), key=mx.random.key(8))
    calls = gathers_on_a_gpu(monkeypatch)
    layer, selection = layer_with(mx.float32, *adapters.items())
    got = run(layer, selection, [2, 0, 3, 1], x)
    monkeypatch.undo()
    assert len(calls) == 1
    for row, slot in enumerate([2, 0, 3, 1]):
        want = layer.base(x[row : row + 1])
        if slot:
            want = reference(layer.base, adapters[slot], x[row : row + 1])
            assert close(got[row : row + 1], want)
        else:
            assert mx.array_equal(got[row : row + 1], want)


@pytest.mark.parametrize("slots", [[3, 0, 1, 3], [2, 0, 5, 1]], ids=["few-of-many", "most"])
def test_each_row_keeps_its_own_columns_of_x_a(
    slots: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the stacks' layout (contiguous (adapters, in, r), or the transposed view of
    the CUDA kernels' (adapters, r, in)), and whether the rows use a few of the held adapters
    (their A taken out of the stacks) or most of them."""
    held = frozenset(range(1, 6))  # slots 1-5, at places 1-5
    at = mx.random.normal((5, 8, D_IN), key=mx.random.key(9))
    x = mx.random.normal((4, 5, D_IN), key=mx.random.key(10))
    selection = Selection()
    selection.set(slots)
    plan = selection.plan(held, len(slots))
    assert plan is not None
    b = mx.zeros((5, 8, D_OUT))
    view = _Stacks(at.swapaxes(1, 2), b, None, held, direct=False)
    contiguous = replace(view, a=mx.contiguous(view.a))
    take, taken = mx.take, []

    def counted(*args: object, **kwargs: object) -> mx.array:
        taken.append(1)
        return take(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mx, "take", counted)
    for stacks in (view, contiguous):
        got = _own_columns(x, stacks, plan)
        for row, slot in enumerate(slots):
            if slot:
                want = x[row] @ at[slot - 1].T
                assert mx.allclose(got[row], want, rtol=1e-5, atol=1e-5).item()
    assert len(taken) == (2 if len({s for s in slots if s}) * 2 <= len(held) else 0)


def test_rows_of_several_adapters_and_none_each_get_their_own(dtype: mx.Dtype) -> None:
    one, two = adapter(1, 4, 10.0), adapter(2, 2, 2.5)
    layer, selection = layer_with(dtype, (1, one), (2, two))
    x = mx.random.normal((4, 5, D_IN), key=mx.random.key(4)).astype(dtype)
    got = run(layer, selection, [2, 0, 1, 1], x)
    assert close(got[0:1], reference(layer.base, two, x[0:1]))
    assert mx.array_equal(got[1:2], layer.base(x)[1:2])  # slot 0: the base, to the bit
    assert close(got[2:4], reference(layer.base, one, x[2:4]))
    # the same rows through the one-adapter path and through the gathered path agree
    assert close(got[2:4], run(layer, selection, [1, 1], x[2:4]))
    padded = run(layer, selection, [2, 1], x[:3])  # rows past the named ones: the base
    assert mx.array_equal(padded[2:3], layer.base(x[:3])[2:3])


def test_a_projection_none_of_the_rows_adapters_touch_is_the_base_projection() -> None:
    layer, selection = layer_with(mx.float32, (1, adapter(1, 4, 10.0)))
    x = mx.random.normal((2, 3, D_IN), key=mx.random.key(5))
    assert mx.array_equal(run(layer, selection, [2, 0], x), layer.base(x))
    assert mx.array_equal(run(layer, selection, [3], x), layer.base(x))


def test_dropping_an_adapter_leaves_the_others_in_their_slots() -> None:
    one, two = adapter(1, 4, 10.0), adapter(2, 2, 2.5)
    layer, selection = layer_with(mx.float32, (1, one), (2, two))
    x = mx.random.normal((2, 3, D_IN), key=mx.random.key(6))
    layer.put(1, None)
    got = run(layer, selection, [2, 1], x)
    assert close(got[0:1], reference(layer.base, two, x[0:1]))
    assert mx.array_equal(got[1:2], layer.base(x)[1:2])


def test_a_biased_base_and_then_no_adapter_at_all(dtype: mx.Dtype) -> None:
    """The bias is added once, on every path; once its last adapter is dropped the layer is
    the base again, to the bit."""
    base = nn.Linear(D_IN, D_OUT, bias=True)
    base.set_dtype(dtype)
    selection = Selection()
    layer = RowLoRA(base, selection)
    one, two = adapter(1, 4, 10.0), adapter(2, 2, 2.5)
    layer.put(1, one)
    layer.put(2, two)
    x = mx.random.normal((2, 3, D_IN), key=mx.random.key(7)).astype(dtype)
    assert close(run(layer, selection, [1], x), reference(base, one, x))
    mixed = run(layer, selection, [2, 1], x)
    assert close(mixed[0:1], reference(base, two, x[0:1]))
    assert close(mixed[1:2], reference(base, one, x[1:2]))
    layer.put(1, None)
    layer.put(2, None)
    assert mx.array_equal(run(layer, selection, [1], x), base(x))
    assert mx.array_equal(run(layer, selection, [2, 1], x), base(x))


def test_a_forward_plans_its_rows_once_for_every_layer() -> None:
    selection = Selection()
    selection.set([2, 0, 1])
    held = frozenset({1, 2})
    plan = selection.plan(held, 3)
    assert plan is not None and plan.single is None
    assert plan.idx.tolist() == [2, 0, 1]
    assert selection.plan(frozenset({1, 2}), 3) is plan  # every layer holding them shares it
    only_one = selection.plan(frozenset({1}), 3)
    assert only_one is not None and only_one.idx.tolist() == [0, 0, 1]
    assert selection.plan(frozenset({3}), 3) is None
    selection.set([1, 1, 1])
    uniform = selection.plan(held, 3)
    assert uniform is not None and uniform.single == 1
    selection.clear()
    selection.set([2, 0, 1])  # a later forward on the same slots: no new slot arrays
    assert selection.plan(held, 3) is plan


def test_the_stacks_hold_the_mounted_adapters_and_nothing_else(dtype: mx.Dtype) -> None:
    """No zeros for "no adapter" or for a dropped adapter's slot: with slots 1 and 3 mounted
    (2 dropped) the stacks are two adapters deep, and rows of none (base rows, padding, rows of
    the dropped slot) in a batch with adapted rows get the base's output exactly."""
    one, two, three = adapter(1, 8, 2.0), adapter(2, 8, 3.0), adapter(3, 8, 0.5)
    layer, selection = layer_with(dtype, (1, one), (2, two), (3, three))
    layer.put(2, None)
    stacks = layer._slots.stacks
    assert stacks is not None and stacks.a.shape[0] == stacks.b.shape[0] == 2
    x = mx.random.normal((4, 3, D_IN), key=mx.random.key(5)).astype(dtype)
    rows = run(layer, selection, [3, 0, 1, 2], x)
    base = layer.base(x)  # the batch's product: a BLAS may round one row alone differently
    assert close(rows[0:1], reference(layer.base, three, x[0:1]))
    assert mx.array_equal(rows[1:2], base[1:2]).item()
    assert close(rows[2:3], reference(layer.base, one, x[2:3]))
    assert mx.array_equal(rows[3:4], base[3:4]).item()
    padded = run(layer, selection, [3, 1], x)  # rows past the named slots: padding, on the base
    assert mx.array_equal(padded[2:], base[2:]).item()


def test_adapters_are_held_once_in_the_stacks() -> None:
    """A layer's memory grows by its stacks alone (each adapter's place in them): the
    per-adapter weights it keeps are views of them, not copies."""
    layer, _ = layer_with(mx.float32)
    mx.eval(layer.base.parameters())
    one, two = adapter(1, 8, 2.0), adapter(2, 8, 2.0)
    mx.eval(one.a, one.b, two.a, two.b)
    loaded = sum(a.nbytes for a in (one.a, one.b, two.a, two.b))
    gc.collect()  # earlier tests' arrays go now, not during the measurement
    before = mx.get_active_memory() - loaded
    layer.put(1, one)
    layer.put(2, two)
    del one, two  # as read from their files: dropped once mounted
    gc.collect()
    stacks = layer._slots.stacks
    assert stacks is not None
    copied = mx.get_active_memory() - before - (stacks.a.nbytes + stacks.b.nbytes)
    assert copied < loaded // 2  # a copy of each adapter would be `loaded`


def test_stacks_shrink_to_the_largest_rank_held_and_each_counts_its_own() -> None:
    """A rank-64 adapter pads the stacks while it is held; once it is dropped, the rank-4 ones
    mounted beside it restack at their own (aligned) rank, answer as before, and each counts
    its own bytes throughout (not the padding the big one imposed)."""
    small, big, later = adapter(1, 4, 2.0), adapter(2, 64, 2.0), adapter(3, 4, 2.0)
    layer, selection = layer_with(mx.float32, (1, small))
    own = (D_IN + D_OUT) * 8 * 4  # rank 4 held at 8 (`RANK_ALIGN`), float32
    assert layer.put(2, big) == (D_IN + D_OUT) * 64 * 4
    assert layer.put(3, later) == own  # mounted while the stacks are 64 wide
    x = mx.random.normal((2, 3, D_IN), key=mx.random.key(7))
    before = run(layer, selection, [1, 3], x)
    assert layer.put(2, None) == 0
    stacks = layer._slots.stacks
    assert stacks is not None and stacks.a.shape[-1] == 8
    after = run(layer, selection, [1, 3], x)
    assert close(after, before)
    assert close(after[0:1], reference(layer.base, small, x[0:1]))
    assert close(after[1:2], reference(layer.base, later, x[1:2]))
    assert all(w.nbytes == own for w in layer._slots.by_slot.values())
