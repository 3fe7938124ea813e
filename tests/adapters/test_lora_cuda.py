"""The CUDA decode path of `RowLoRA`: its kernels against MLX ops (on MLX's CUDA build), and
everywhere the dispatch around them: which projections share one call per forward and which
output each takes, with the kernels' arithmetic done by MLX ops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlxd.engine import lora, lora_cuda
from mlxd.engine.attention import cuda_available
from mlxd.engine.fusedproj import fuse_gate_up
from mlxd.engine.lora import LayerWeights, Selection, wrap
from mlxd.engine.smallarrays import kernel_array

PROJECTIONS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]  # fmt: skip


def place(idx: mx.array) -> mx.array:
    """Each row's place in the stacks (idx - 1; a row of none reads place 0, its term zeroed)."""
    return mx.maximum(idx, 1) - 1


def project_by_ops(
    x: mx.array, idx: mx.array | None, parts: list[lora_cuda.Part]
) -> list[mx.array]:
    """The kernels' arithmetic: idx 0 (no adapter) has no term, idx i reads the stacks' (i-1)th."""
    flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
    ys = []
    for at, weight, bt, bias in parts:
        y = flat @ weight.astype(mx.float32).T
        if idx is not None and at is not None and bt is not None:
            on = (idx != 0)[:, None]
            h = on * (flat[:, None, :] * at[place(idx)].astype(mx.float32)).sum(-1)
            y = y + on * (h[:, None, :] * bt[place(idx)]).sum(-1)
        if bias is not None:
            y = y + bias.astype(mx.float32)
        ys.append(y.astype(x.dtype).reshape(*x.shape[:-1], weight.shape[0]))
    return ys


@pytest.fixture
def on_the_cpu() -> Iterator[None]:
    """The dispatch tests compute the kernels' arithmetic by MLX ops in float32: on the CPU,
    whatever the machine, so the references are exact."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


def tiny_model(seed: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
    )  # fmt: skip
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def mount(model: nn.Module, selection: Selection) -> None:
    """Three adapters on every projection, except that slot 3 leaves block 1's k_proj alone."""
    for layer in range(2):
        for path in PROJECTIONS:
            row = wrap(model, f"model.layers.{layer}.{path}", selection)
            d_out, d_in = row.base.weight.shape
            for slot in (1, 2, 3):
                if slot == 3 and layer == 1 and path.endswith("k_proj"):
                    continue
                rank = 16 if slot == 2 else 8
                ka, kb = mx.random.split(mx.random.key(10 * slot + layer))
                a = 0.3 * mx.random.normal((d_in, rank), key=ka)
                b = 0.3 * mx.random.normal((rank, d_out), key=kb)
                row.put(slot, LayerWeights(a, b, 2.0))


def logits_on(
    slots: list[int], tokens: mx.array, *models: tuple[nn.Module, Selection]
) -> list[mx.array]:
    """Each model's logits for `tokens`, its rows on `slots`."""
    outs = []
    for model, selection in models:
        selection.set(slots)
        outs.append(model(tokens))
        selection.clear()
    return outs


# `mount`'s adapters on rows of one slot: block 0's q, k, v in one call; block 1's k holds other
# slots than its q and v, so a call of its own
ONE_ROW_CALLS = [(n, True) for n in (3, 1, 2, 1, 2, 1, 1, 2, 1)]


def kernel_and_ops_models(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> tuple[tuple[nn.Module, Selection], tuple[nn.Module, Selection]]:
    """Two copies of one model with `mount`'s adapters: the first on the MLX ops, the second
    routed to the kernels (`lora_cuda.project`, which a test replaces)."""
    plain_sel, fused_sel = Selection(), Selection()
    plain, fused = tiny_model(seed), tiny_model(seed)
    mount(plain, plain_sel)
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype, count, bias, term: None)
    mount(fused, fused_sel)
    return (plain, plain_sel), (fused, fused_sel)


@pytest.mark.usefixtures("on_the_cpu")
def test_projections_of_one_input_share_one_call_per_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q, k, v (and gate, up) take their outputs from one call; a projection whose adapters
    differ (k without slot 3) gets its own; every row's logits are the MLX-ops path's."""
    (plain, plain_sel), (fused, fused_sel) = kernel_and_ops_models(monkeypatch, 0)
    calls = counted_calls(monkeypatch)
    expected = ONE_ROW_CALLS
    for slots, length in (([1], 1), ([2, 0, 1], 2)):
        tokens = mx.array([[(5 * r + t) % 50 for t in range(length)] for r in range(len(slots))])
        calls.clear()
        outs = logits_on(slots, tokens, (fused, fused_sel), (plain, plain_sel))
        assert calls == expected
        assert mx.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4).item()
    calls.clear()
    fused_sel.set([3])  # block 1's k_proj is the base's for these rows: MLX's matmul
    fused(mx.array([[1, 2]]))
    fused_sel.clear()
    assert calls == [*expected[:5], *expected[6:]]


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("others", [[], [0, 1]], ids=["lone row", "batch"])
def test_a_decoding_rows_steps_keep_their_routes_until_an_adapter_changes(
    monkeypatch: pytest.MonkeyPatch, others: list[int]
) -> None:
    """A lone row's (or a batch's) later steps on the same slots call the kernels as its first
    did without deciding their routes again; remounting an adapter (new weights at the same
    slot, on one projection of a group) and changing a row's slot are followed at the next
    step."""
    (plain, plain_sel), (fused, fused_sel) = kernel_and_ops_models(monkeypatch, 4)
    calls = counted_calls(monkeypatch)
    tokens = mx.array([[7 + r] for r in range(1 + len(others))])
    decided: list[int] = []
    route = lora.RowLoRA._route
    monkeypatch.setattr(
        lora.RowLoRA, "_route", lambda self, x, plan: decided.append(1) or route(self, x, plan)
    )

    def step(slot: int) -> None:
        calls.clear()
        got, want = logits_on([slot, *others], tokens, (fused, fused_sel), (plain, plain_sel))
        assert calls == ONE_ROW_CALLS
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()

    step(1)
    assert decided
    decided.clear()
    step(1)
    assert not decided  # the second step routed as the first
    ka, kb = mx.random.split(mx.random.key(99))
    for model, selection, kernels in ((plain, plain_sel, False), (fused, fused_sel, True)):
        row = wrap(model, "model.layers.1.self_attn.v_proj", selection)
        d_out, d_in = row.base.weight.shape
        a, b = mx.random.normal((d_in, 8), key=ka), mx.random.normal((8, d_out), key=kb)
        with monkeypatch.context() as patched:
            patched.setattr(lora, "_decodes_fused", lambda base, kernels=kernels: kernels)
            row.put(1, LayerWeights(a, b, 2.0))
    step(1)
    step(2)


def counted_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """`lora_cuda.project` by MLX ops, each call noted as (projections, with terms); a call
    bound once for a decoding row's steps (`lora_cuda.bound`) is noted at each step."""
    calls: list[tuple[int, bool]] = []

    def counted(x: mx.array, idx: mx.array | None, parts: list[lora_cuda.Part]) -> list[mx.array]:
        calls.append((len(parts), idx is not None))
        return project_by_ops(x, idx, parts)

    def bound(
        idx: mx.array | None, parts: list[lora_cuda.Part]
    ) -> Callable[[mx.array], list[mx.array]]:
        return lambda x: counted(x, idx, parts)

    monkeypatch.setattr(lora_cuda, "project", counted)
    monkeypatch.setattr(lora_cuda, "bound", bound)
    return calls


@pytest.mark.usefixtures("on_the_cpu")
def test_batches_base_rows_take_the_kernels_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `MLXD_BATCH_KERNELS=1` and no adapters, in a forward queued behind another: a
    batch's q, k, v (and gate, up) in one call each, o_proj alone, down_proj alone with the
    tensor-core kernel (else by MLX's matmul); one row x token and a prompt by MLX ops, 9 rows
    x tokens (a verify's shape) by the tensor-core kernel (else by MLX ops); logits unchanged.
    A forward not queued takes MLX ops. Without it nothing is wrapped."""
    monkeypatch.setenv("MLXD_BATCH_KERNELS", "1")
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora, "_on_gpu", lambda: True)
    monkeypatch.setattr(lora, "cuda_available", lambda: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype, count, bias, term: None)
    for mma, wrapped, batch in (("1", 7, [3, 1, 2, 1]), ("0", 6, [3, 1, 2])):
        monkeypatch.setenv("MLXD_MMA", mma)
        plain, fused = tiny_model(2), tiny_model(2)
        assert lora.wrap_for_decoding(fused, Selection()) == 2 * wrapped
        calls = counted_calls(monkeypatch)
        verify = batch if mma == "1" else []
        for rows, length, expected in ((1, 1, []), (2, 1, batch), (1, 9, verify), (1, 33, [])):
            tokens = mx.array([[(3 * r + t) % 50 for t in range(length)] for r in range(rows)])
            for queued in (True, False):
                calls.clear()
                with lora_cuda.queued() if queued else contextlib.nullcontext():
                    got, want = fused(tokens), plain(tokens)
                assert calls == [(n, False) for n in (expected if queued else []) * 2]
                assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
    monkeypatch.setenv("MLXD_BATCH_KERNELS", "0")
    assert lora.wrap_for_decoding(tiny_model(2), Selection()) == 0


@pytest.mark.usefixtures("on_the_cpu")
def test_rows_past_the_kernels_limit_take_the_mlx_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype, count, bias, term: None)
    model, selection = tiny_model(1), Selection()
    mount(model, selection)

    def refused(*args: object) -> None:
        raise AssertionError("the kernels took more rows than they serve")

    monkeypatch.setattr(lora_cuda, "project", refused)
    selection.set([1])
    past = lora_cuda.MAX_ROWS + 1  # adapted rows past 8 rows x tokens: a verify, a prompt
    logits = model(mx.zeros((1, past), dtype=mx.int32))
    selection.clear()
    assert logits.shape == (1, past, 50)


def rand(*shape: int) -> mx.array:
    return (0.05 * mx.random.normal(shape)).astype(mx.bfloat16)


@pytest.mark.skipif(not cuda_available(), reason="the kernels run on MLX's CUDA build")
def test_kernels_match_mlx_ops() -> None:
    dtype = mx.bfloat16
    for k, (n0, n1) in ((64, (48, 40)), (512, (1024, 8)), (2048, (256, 512)), (256, (4104, 24))):
        for slots, length in (([1], 1), ([2, 0, 1, 1], 1), ([1, 2], 3), ([1] * 8, 1)):
            mx.random.seed(k + n0 + len(slots))
            x = mx.random.normal((len(slots), length, k)).astype(dtype)
            idx = mx.repeat(mx.array(slots, dtype=mx.uint32), length)
            parts = [
                lora_cuda.Part(rand(3, r, k), rand(n, k), rand(3, n, r), None)
                for n, r in ((n0, 8), (n1, 16))
            ]
            for biased, term in ((False, True), (False, False), (True, True), (True, False)):
                if biased:
                    parts = [p._replace(bias=rand(p.weight.shape[0])) for p in parts]
                if not term:
                    plain = [p._replace(at=None, bt=None) for p in parts]
                want_all = project_by_ops(x, idx, parts if term else plain)
                routes = [lora_cuda.project(x, idx if term else None, parts if term else plain)]
                if term:  # idx as the engine makes it (a view of a padded array)
                    held = kernel_array(idx.tolist(), mx.uint32)
                    routes.append(lora_cuda.project(x, held, parts))
                if term:  # the project kernel's own terms, and the term kernel
                    flat = [
                        a for p in parts for a in (p.weight, p.at, p.bt, p.bias) if a is not None
                    ]
                    for extra in ({"matmul_rows": 99}, {"fused": True}):
                        routes.append(
                            lora_cuda._project(x, idx, *flat, bias=biased, term=True, **extra)
                        )
                for got in routes:
                    for y, want in zip(got, want_all, strict=True):
                        y, want = y.astype(mx.float32), want.astype(mx.float32)
                        tol = 2e-2 * mx.abs(want).max().item()
                        assert mx.allclose(y, want, rtol=0.0, atol=tol).item(), (k, slots, length)


def down_by_ops(count: int) -> object:
    """`_down_kernel`'s arithmetic as a kernel call: h_i = x A_i[idx], float32."""

    def call(inputs: list[mx.array], **_: object) -> list[mx.array]:
        x, *ats, idx = inputs
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        on = (idx != 0)[:, None]
        return [on * (flat[:, None, :] * at[place(idx)].astype(mx.float32)).sum(-1) for at in ats]

    return call


def up_by_ops(count: int) -> object:
    """`_up_kernel`'s arithmetic as a kernel call: out_i = y_i + h_i sB_i[idx]^T."""

    def call(inputs: list[mx.array], **_: object) -> list[mx.array]:
        idx, rest = inputs[0], inputs[1:]
        on = (idx != 0)[:, None]
        outs = []
        for y, h, bt in zip(rest[0::3], rest[1::3], rest[2::3], strict=True):
            flat = y.reshape(-1, y.shape[-1]).astype(mx.float32)
            term = on * (h[:, None, :] * bt[place(idx)].astype(mx.float32)).sum(-1)
            outs.append((flat + term).astype(y.dtype).reshape(y.shape))
        return outs

    return call


def term_by_ops(count: int, shared: bool = False) -> object:
    """`_term_kernel`'s arithmetic as a kernel call: out_i = y_i + (x A_i[idx]) sB_i[idx]^T,
    the y_i given, or (`shared`) columns offsets[i].. of one y."""

    def call(inputs: list[mx.array], **_: object) -> list[mx.array]:
        x, idx = inputs[0], inputs[1]
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        on = (idx != 0)[:, None]
        if shared:
            y, offsets, rest = inputs[2], inputs[3].tolist(), inputs[4:]
            terms = list(zip(rest[0::2], rest[1::2], strict=True))
            ys = [y[..., o : o + bt.shape[1]] for o, (_, bt) in zip(offsets, terms, strict=True)]
        else:
            rest = inputs[2:]
            ys, terms = list(rest[0::3]), list(zip(rest[1::3], rest[2::3], strict=True))
        outs = []
        for y, (at, bt) in zip(ys, terms, strict=True):
            h = (flat[:, None, :] * at[place(idx)].astype(mx.float32)).sum(-1)
            term = on * (h[:, None, :] * bt[place(idx)].astype(mx.float32)).sum(-1)
            out = y.reshape(-1, y.shape[-1]) + term
            outs.append(out.astype(y.dtype).reshape(*y.shape[:-1], bt.shape[1]))
        return outs

    return call


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("fused", [True, False], ids=["term", "down+up"])
@pytest.mark.parametrize("biased", [False, True])
def test_several_adapted_rows_take_the_matmul_then_their_terms(
    monkeypatch: pytest.MonkeyPatch, biased: bool, fused: bool
) -> None:
    """Rows x tokens > 1 with terms: MLX's matmul for x W^T (plus bias), then each row's term
    added by one `term` launch (or `down` and `up`); `project` is never launched."""

    def refused(*args: object) -> None:
        raise AssertionError("several rows launched the project kernel")

    def unused(*args: object) -> None:
        raise AssertionError("the other route's kernels were launched")

    monkeypatch.setattr(lora_cuda, "_project_kernel", refused)
    monkeypatch.setattr(lora_cuda, "_down_kernel", down_by_ops if not fused else unused)
    monkeypatch.setattr(lora_cuda, "_up_kernel", up_by_ops if not fused else unused)
    monkeypatch.setattr(lora_cuda, "_term_kernel", term_by_ops if fused else unused)
    mx.random.seed(3)
    k = 32
    parts = [
        lora_cuda.Part(
            mx.random.normal((3, r, k)), mx.random.normal((n, k)), mx.random.normal((3, n, r)),
            mx.random.normal((n,)) if biased else None,
        )
        for n, r in ((24, 8), (40, 16), (8, 8))
    ]  # fmt: skip
    for slots, length in (([2, 0, 1], 1), ([1, 2], 3), ([2], 2)):
        x = mx.random.normal((len(slots), length, k))
        idx = mx.repeat(mx.array(slots, dtype=mx.uint32), length)
        flat = [a for p in parts for a in (p.weight, p.at, p.bt, p.bias) if a is not None]
        got = lora_cuda._project(x, idx, *flat, bias=biased, term=True, fused=fused)
        for y, want in zip(got, project_by_ops(x, idx, parts), strict=True):
            assert y.shape == want.shape
            assert mx.allclose(y, want, rtol=1e-4, atol=1e-3).item(), (slots, length)


@pytest.mark.usefixtures("on_the_cpu")
def test_adapted_rows_on_a_fused_gate_and_up_share_its_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of adapted rows on a model whose gate and up are one matmul: that matmul once
    per block, then one term launch for both; q, k, v and the rest as before; logits as the
    MLX-ops path gives them on the unfused model. A lone row keeps `project`."""
    plain_sel, fused_sel = Selection(), Selection()
    plain, fused = tiny_model(5), tiny_model(5)
    mount(plain, plain_sel)
    assert fuse_gate_up(fused) == 2
    monkeypatch.setattr(lora, "_decodes_fused", lambda base: True)
    monkeypatch.setattr(lora_cuda, "warm", lambda dtype, count, bias, term: None)
    mount(fused, fused_sel)
    calls = counted_calls(monkeypatch)
    shared_terms: list[int] = []
    terms_call = lora_cuda.terms_call

    def counted_terms(idx: mx.array, parts: list, offsets: list) -> Callable:
        call = terms_call(idx, parts, offsets)
        return lambda x, y: shared_terms.append(len(parts)) or call(x, y)

    def term_kernel(count: int, shared: bool = False) -> object:
        assert shared, "a fused pair's terms take the shared form"
        return term_by_ops(count, shared)

    monkeypatch.setattr(lora_cuda, "terms_call", counted_terms)
    monkeypatch.setattr(lora_cuda, "_term_kernel", term_kernel)
    monkeypatch.setattr(lora_cuda, "_compiled_terms", lora_cuda._add_terms)  # traced: no host
    # `project` calls: block 0 q+k+v, o, (gate+up), down; block 1 q+v, k, o, (gate+up), down
    batch, lone = [3, 1, 1, 2, 1, 1, 1], [3, 1, 2, 1, 2, 1, 1, 2, 1]
    cases = (([2, 0, 1], 1, [2, 2], batch), ([1], 1, [], lone))
    # each twice: the second step on the same slots replays the routes the first one bound
    for slots, length, pairs, projects in (c for c in cases for _ in range(2)):
        tokens = mx.array([[(5 * r + t) % 50 for t in range(length)] for r in range(len(slots))])
        calls.clear()
        shared_terms.clear()
        outs = logits_on(slots, tokens, (fused, fused_sel), (plain, plain_sel))
        assert shared_terms == pairs
        assert calls == [(n, True) for n in projects]  # a lone row's gate and up: `project`
        assert mx.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4).item()


@pytest.mark.skipif(not cuda_available(), reason="the kernels run on MLX's CUDA build")
def test_terms_on_a_fused_output_match_mlx_ops() -> None:
    """`terms_call` on columns of one fused matmul's output, as a fused gate and up give it."""
    dtype = mx.bfloat16
    for k, sizes, slots in ((64, (48, 40), [1, 0, 2]), (512, (4104, 2056), [2] * 8)):
        mx.random.seed(k)
        x = mx.random.normal((len(slots), 1, k)).astype(dtype)
        idx = mx.array(slots, dtype=mx.uint32)
        parts = [lora_cuda.Part(rand(3, 8, k), rand(n, k), rand(3, n, 8), None) for n in sizes]
        y = x @ mx.concatenate([p.weight for p in parts]).T
        got = lora_cuda.terms_call(idx, parts, [0, sizes[0]])(x, y)
        for out, want in zip(got, project_by_ops(x, idx, parts), strict=True):
            out, want = out.astype(mx.float32), want.astype(mx.float32)
            tol = 2e-2 * mx.abs(want).max().item()
            assert mx.allclose(out, want, rtol=0.0, atol=tol).item(), (k, slots)
