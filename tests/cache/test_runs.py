"""Blocks offered together are views of one copy (a run) and restore as one slice of it."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxd.engine.cache_use import offer_caches
from mlxd.engine.prefix_cache import Namespace, PrefixCache, RamTier, build_caches, slice_run
from tests.cache.blocks import BLOCK, chain

NS = Namespace(model="runs")
LAYERS = 3


def filled(tokens: int, seed: int) -> list[Any]:
    """Real mlx-lm caches holding `tokens` positions of seeded K/V."""
    rng = np.random.default_rng(seed)
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        k, v = (mx.array(rng.standard_normal((1, 2, tokens, 8)).astype(np.float32)) for _ in "kv")
        c.update_and_fetch(k, v)
        caches.append(c)
    return caches


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b))


def restored_equals(got: list[Any], want: list[Any], tokens: int) -> bool:
    return all(
        int(g.offset) == tokens
        and same(g.keys[..., :tokens, :], w.keys[..., :tokens, :])
        and same(g.values[..., :tokens, :], w.values[..., :tokens, :])
        for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("bucket", [None, 1024])
def test_offered_blocks_share_one_run_and_restore_exactly(bucket: int | None) -> None:
    n = 5 * BLOCK + 10
    tokens = chain(6)[:n]
    caches = filled(n, seed=1)
    cache = PrefixCache(1 << 30)
    assert offer_caches(cache, NS, caches, tokens) == 6  # five blocks and the partial one
    found = cache.lookup(NS, tokens)
    assert [b.tokens for b in found] == [BLOCK] * 5 + [10]
    runs = {id(b.run) for b in found[:5]}
    assert len(runs) == 1 and found[0].run is not None
    assert all(b.follows(a) for a, b in itertools.pairwise(found[:5]))
    assert restored_equals(build_caches(found, 0, LAYERS, bucket), caches, n)


def test_a_longer_prompt_restores_across_two_runs() -> None:
    tokens = chain(7)
    longer = filled(7 * BLOCK, seed=2)
    first = []  # the same K/V for the shared prefix
    for c in longer:
        f = KVCache()
        f.update_and_fetch(c.keys[..., : 3 * BLOCK, :], c.values[..., : 3 * BLOCK, :])
        first.append(f)
    cache = PrefixCache(1 << 30)
    offer_caches(cache, NS, first, tokens[: 3 * BLOCK])
    offer_caches(cache, NS, longer, tokens)
    found = cache.lookup(NS, tokens)
    assert len(found) == 7
    assert found[2].run is not found[3].run  # two offers, two runs
    assert restored_equals(build_caches(found, 0, LAYERS, None), longer, 7 * BLOCK)


def test_a_run_half_evicted_leaves_its_survivors_their_own_copies() -> None:
    caches = filled(4 * BLOCK, seed=3)
    blocks = slice_run(caches, 0, 4 * BLOCK, BLOCK)
    assert blocks is not None and len(blocks) == 4
    run = blocks[0].run
    assert run is not None
    ram = RamTier(4 * blocks[0].nbytes)
    for i, b in enumerate(blocks):
        assert ram.put(f"k{i}", b) == []
    assert run.keys == {"k0", "k1", "k2", "k3"}
    ram.drop("k0")
    assert ram.entries["k1"].run is run  # three of four left: still views
    ram.drop("k1")
    for i in (2, 3):
        kept = ram.entries[f"k{i}"]
        assert kept.run is None
        for layer, want in zip(kept.arrays, caches, strict=True):
            assert same(layer[0], want.keys[..., i * BLOCK : (i + 1) * BLOCK, :])
            assert same(layer[1], want.values[..., i * BLOCK : (i + 1) * BLOCK, :])
    assert not run.keys
    assert ram.nbytes == sum(b.nbytes for b in ram.entries.values())


def test_a_finished_rows_run_views_its_cache_and_a_live_rows_copies_it() -> None:
    """A live row's cache keeps being written (a view would stop MLX updating it in place);
    a finished row's is written no more, so its blocks are views of it: offering copies
    nothing, and they restore as exactly."""
    n = 4 * BLOCK
    tokens = chain(4)
    for finished in (False, True):
        caches = filled(n, seed=5)
        cache = PrefixCache(1 << 30)
        assert offer_caches(cache, NS, caches, tokens, finished=finished) == 4
        found = cache.lookup(NS, tokens)
        assert len(found) == 4
        for block in found:
            for layer, c in zip(block.arrays, caches, strict=True):
                shared = np.shares_memory(np.asarray(layer[0]), np.asarray(c.keys))
                assert shared == finished
        assert restored_equals(build_caches(found, 0, LAYERS, None), caches, n)


def test_blocks_are_written_through_only_where_the_ssd_beats_recomputing(
    tmp_path: Path,
) -> None:
    """A device whose prefill outruns the disk never reads the SSD back (`ssd_pays`), so
    writing every block through to it would only cost the rows decoding meanwhile; such
    blocks stay in RAM and reach the disk when evicted or at shutdown."""
    tokens = chain(4)
    cache = PrefixCache(1 << 30, tmp_path / "ssd", 1 << 30)
    ssd = cache.ssd
    assert ssd is not None and ssd.read_rate > 0
    try:
        fast = ssd.read_rate * 10  # bytes of K/V per second the prefill makes
        assert offer_caches(cache, NS, filled(4 * BLOCK, seed=6), tokens, recompute_rate=fast) == 4
        ssd.flush()
        assert len(ssd.cache) == 0 and len(cache.lookup(NS, tokens)) == 4
        other = Namespace(model="runs-slow")
        assert offer_caches(cache, other, filled(4 * BLOCK, seed=7), tokens) == 4
        ssd.flush()
        assert len(ssd.cache) == 4
        cache.persist()
        assert len(ssd.cache) == 8
    finally:
        cache.close()


def test_the_ram_tier_counts_what_finished_rows_blocks_keep_alive() -> None:
    """A finished row's blocks view its cache buffers whole (their padding, the tokens past
    the offered range): the tier counts those buffers, once for every run viewing them, so
    its budget bounds the memory it holds, blocks partly evicted included. Counting the
    views' bytes alone, the memory held reached 1.3x the budget when full and 2.5x once
    half of each run was dropped."""
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    probe = filled(20 * BLOCK + 16, seed=9)  # a buffer past the range: a step of padding
    budget = 6 * sum(p.nbytes for c in probe for p in (c.keys, c.values))
    del probe
    ram = RamTier(budget)
    for r in range(12):  # each row offers its prompt's blocks, then its whole sequence's
        caches = filled(20 * BLOCK + 16, seed=10 + r)
        prompt = slice_run(caches, 0, 15 * BLOCK, BLOCK, finished=True)
        rest = slice_run(caches, 15 * BLOCK, 20 * BLOCK, BLOCK, finished=True)
        assert prompt is not None and rest is not None
        for i, b in enumerate(prompt + rest):
            ram.put(f"r{r}:{i}", b)
        del caches, prompt, rest
    for share in (3, 2):  # a third of every row's blocks, then half of the rest
        for key in [k for k in ram.entries if int(k.split(":")[1]) % share == 0]:
            ram.drop(key)
        gc.collect()
        mx.synchronize()
        held = mx.get_active_memory() - base
        assert ram.nbytes <= budget
        assert held <= 1.05 * budget, (held / budget, ram.nbytes / budget)
        assert held >= 0.9 * ram.nbytes, (held / budget, ram.nbytes / budget)


def test_a_finished_rows_short_range_in_a_long_buffer_is_copied() -> None:
    """A view keeps the whole buffer alive: two blocks of a 400-token buffer (512 allocated)
    are copied rather than viewed; four of them (half the buffer) are viewed."""
    caches = filled(400, seed=21)
    for blocks, shared in ((2, False), (4, True)):
        run = slice_run(caches, 0, blocks * BLOCK, BLOCK, finished=True)
        assert run is not None
        view = np.asarray(run[0].arrays[0][0])
        assert np.shares_memory(view, np.asarray(caches[0].keys)) == shared
