"""Padding a forward's projections to a cheaper row count changes no row's output."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from mlxd.engine import rowpad
from mlxd.engine.backend import configure_backend
from mlxd.engine.batch import RowBatch
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import close_target, load_pairing
from mlxd.engine.probestore import ProbeStore
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import TinyPair

# an 8B bf16 target on an H200 (ms): 2-6 tokens cost 1.5 steps, 8-16 one
BF16 = {1: 8.44, 2: 12.61, 3: 12.78, 4: 12.55, 5: 12.82, 6: 12.56, 8: 8.54, 12: 8.73, 16: 8.40}
# the same in 4-bit: every token costs until 8, which costs as 3
Q4 = {1: 7.8, 2: 12.23, 3: 16.72, 4: 21.12, 5: 25.45, 6: 30.64, 8: 16.64, 12: 16.84, 16: 17.01}
# a 7B-shaped 4-bit target, and an 8B bf16 one on a noisy day (v(L), H200)
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)
FAT_Q4 = dict(
    zip(WIDTHS, (1.0, 1.55, 1.96, 2.39, 2.84, 3.37, 3.76, 2.18, 2.15, 2.14, 2.17), strict=True)
)
NOISY = dict(
    zip(WIDTHS, (1.0, 1.67, 1.59, 1.54, 1.37, 1.33, 1.48, 1.53, 1.63, 1.49, 1.44), strict=True)
)
PAD = {2: 8, 3: 8, 5: 8, 6: 8}


def test_plan_pads_to_the_narrowest_of_the_cheapest_wider_forwards() -> None:
    assert rowpad.plan(BF16) == {2: 8, 3: 8, 4: 8, 5: 8, 6: 8}
    assert rowpad.plan(Q4) == {5: 8, 6: 8}
    assert rowpad.plan(FAT_Q4) == {6: 8, 7: 8}
    assert rowpad.plan(NOISY) == {}  # a noisy curve's dips are no cliff
    cpu = {w: 1.0 + 0.4 * w for w in (1, 2, 3, 4, 8, 16)}  # compute-bound: monotonic
    assert rowpad.plan(cpu) == {}


def test_a_cliff_in_batched_rounds_pads_though_the_verify_curve_shows_none() -> None:
    """An 8B bf16 target on an H200: a round of 2 or 4 rows cost 15.4 and 13.8 ms and one of
    8 rows 9.2 (one row 9.2); the same day's verify curve was flat and noisy."""
    rows = {1: 9.16, 2: 15.36, 3: 15.1, 4: 13.78, 5: 13.2, 6: 12.9, 7: 12.4, 8: 9.19}
    assert rowpad.plan_both(NOISY, rows) == {2: 8, 3: 8, 4: 8, 5: 8, 6: 8, 7: 8}
    assert rowpad.plan_both(FAT_Q4, {b: 1.0 + 0.1 * b for b in range(1, 9)}) == {6: 8, 7: 8}


def fresh(pair: TinyPair) -> nn.Module:
    model = load(str(pair.target))[0]
    model.set_dtype(mx.float32)
    return model


def test_padded_forwards_match_unpadded(tiny_pair: TinyPair) -> None:
    plain, padded = fresh(tiny_pair), fresh(tiny_pair)
    assert rowpad.install(padded, PAD) > 0
    assert rowpad.padding_of(padded) == PAD and rowpad.padding_of(plain) == {}
    rowpad.install(plain, PAD)
    rowpad.install(plain, {})  # taken off again
    assert rowpad.padding_of(plain) == {}
    assert all(type(m) is nn.Linear for _, m in plain.named_modules() if isinstance(m, nn.Linear))
    assert all(
        isinstance(m, nn.Linear) for _, m in padded.named_modules() if isinstance(m, rowpad._Padded)
    )
    prompt = mx.array([[5, 9, 14, 3, 22, 7]])
    for width in (1, 2, 3, 5, 6, 7):  # padded widths and not
        ca, cb = make_cache(plain), make_cache(padded)
        a = plain(prompt[:, :width], cache=ca)
        b = padded(prompt[:, :width], cache=cb)
        assert mx.allclose(a, b, atol=1e-5).item(), width
        # a BLAS may block a product of 8 rows differently: equal to rounding, not bitwise
        assert all(
            mx.allclose(x.keys, y.keys, atol=1e-5).item() for x, y in zip(ca, cb, strict=True)
        )


def decode_rows(model: nn.Module, prompts: list[list[int]], temp: float) -> list[list[int]]:
    opts = parse_options({"temperature": temp, "seed": 3})
    gens = [Generation(model, p, opts, set(), 12, Rng(i)) for i, p in enumerate(prompts)]
    for g in gens:
        g.prefill()
    batch = RowBatch(model, Costs(verify={1: 1.0}))
    batch.join(gens)
    while not all(g.done for g in gens):
        batch.round()
    batch.drop_ahead()
    return [g.tokens for g in gens]


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_batched_rows_decode_the_same_padded(tiny_pair: TinyPair, temp: float) -> None:
    """Three rows (padded to 8 in every projection) give the tokens they give unpadded."""
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 6, 7]]
    plain, padded = fresh(tiny_pair), fresh(tiny_pair)
    rowpad.install(padded, PAD)
    assert decode_rows(padded, prompts, temp) == decode_rows(plain, prompts, temp)


def test_the_plan_travels_with_the_probe(tiny_pair: TinyPair, tmp_path: Path) -> None:
    """A stored probe keeps its padding, and a pairing opened with it pads as measured."""
    store = ProbeStore(tmp_path)
    store.save("k", Costs(verify=dict(BF16), padded=dict(PAD)))
    costs = store.load("k")
    assert costs is not None and costs.padded == PAD
    entry = ModelEntry(name="tiny", target=str(tiny_pair.target))
    pairing = load_pairing(entry, configure_backend(), costs)
    try:
        assert rowpad.padding_of(pairing.target) == PAD
    finally:
        close_target(pairing.target)
