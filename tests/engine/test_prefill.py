"""Shaped prefill: power-of-two chunks, padded or not, compute the same cache and logits as one
plain pass."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlxd.engine import kvcache
from mlxd.engine.kvcache import BucketedKVCache, make_cache
from mlxd.engine.prefill import (
    batchable,
    chunk_sizes,
    feed,
    feed_rows,
    paddable,
    padded_sizes,
    row_shape,
)
from mlxd.engine.sampling import to_ints
from tests.engine.conftest import Loaded


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 300, 511, 512, 513, 1500])
def test_shaped_chunks_are_powers_of_two_that_sum_to_n(n: int) -> None:
    sizes = chunk_sizes(n, limit=512, shaped=True)
    assert sum(sizes) == n
    assert all(s & (s - 1) == 0 and s <= 512 for s in sizes)
    assert sizes == sorted(sizes, reverse=True)
    assert len(sizes) - n // 512 <= 9  # at most one chunk per bit below the limit


def test_plain_chunks_keep_one_forward_per_limit() -> None:
    assert chunk_sizes(300, limit=512, shaped=False) == [300]
    assert chunk_sizes(1100, limit=512, shaped=False) == [512, 512, 76]


@pytest.mark.parametrize("n", [5, 37, 300])
def test_shaped_feed_matches_plain_feed(loaded: Loaded, n: int) -> None:
    mx.random.seed(n)
    tokens = to_ints(mx.random.randint(3, 200, (n,)))
    caches = [make_cache(loaded.target) for _ in range(2)]
    shaped = feed(loaded.target, caches[0], tokens, shaped=True)
    plain = feed(loaded.target, caches[1], tokens, shaped=False)
    assert caches[0][0].offset == caches[1][0].offset == n
    assert mx.allclose(shaped, plain, atol=1e-4).item()
    k0, k1 = caches[0][0].keys[..., :n, :], caches[1][0].keys[..., :n, :]
    assert mx.allclose(k0, k1, atol=1e-4).item()


@pytest.mark.parametrize(("n", "sizes"), [(1, [1]), (5, [8]), (300, [512]), (512, [512]),
                                          (1100, [512, 512, 128])])  # fmt: skip
def test_padded_widths_are_one_forward_per_chunk(n: int, sizes: list[int]) -> None:
    assert padded_sizes(n, limit=512) == sizes


@pytest.mark.usefixtures("gpu_layout")
@pytest.mark.parametrize("n", [5, 37, 300, 530])
def test_padded_feed_matches_plain_feed(loaded: Loaded, n: int) -> None:
    """The padding is trimmed off again: same offset, keys and last logits as an exact pass,
    and the next token lands right after the prompt."""
    mx.random.seed(n)
    tokens = to_ints(mx.random.randint(3, 200, (n + 1,)))
    padded, plain = make_cache(loaded.target), make_cache(loaded.target)
    assert paddable(padded)
    got = feed(loaded.target, padded, tokens[:n])
    want = feed(loaded.target, plain, tokens[:n], shaped=False)
    assert padded[0].offset == plain[0].offset == n
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.allclose(padded[0].keys[..., :n, :], plain[0].keys[..., :n, :], atol=1e-4).item()
    step = [feed(loaded.target, c, tokens[n:]) for c in (padded, plain)]
    assert mx.allclose(step[0], step[1], atol=1e-4).item()


@pytest.mark.usefixtures("gpu_layout")
@pytest.mark.parametrize("n", [300, 2048 + 200])
def test_exact_key_chunks_match_masked_ones(
    loaded: Loaded, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wide chunks at aligned offsets attend over exact keys (causal); the rest over the
    padded buffer with a mask: both read the same prompt into the same cache."""
    mx.random.seed(n)
    tokens = to_ints(mx.random.randint(3, 200, (n + 1,)))
    results = []
    for exact_min in (kvcache.EXACT_MIN, 0):
        monkeypatch.setattr(kvcache, "EXACT_MIN", exact_min)
        cache = make_cache(loaded.target)
        last = feed(loaded.target, cache, tokens[:n])
        step = feed(loaded.target, cache, tokens[n:])
        results.append((last, step, cache[0].keys[..., : n + 1, :]))
    (a_last, a_step, a_keys), (b_last, b_step, b_keys) = results
    assert mx.allclose(a_last, b_last, atol=1e-4).item()
    assert mx.allclose(a_step, b_step, atol=1e-4).item()
    assert mx.allclose(a_keys, b_keys, atol=1e-4).item()


def test_only_wide_chunks_at_aligned_offsets_take_exact_keys() -> None:
    cache = BucketedKVCache()
    assert cache.make_mask(kvcache.EXACT_MIN) == "causal"
    assert not isinstance(cache.make_mask(kvcache.EXACT_MIN - 1), str)
    cache.offset = 5
    assert not isinstance(cache.make_mask(kvcache.EXACT_MIN), str)
    cache.offset = kvcache.EXACT_ALIGN
    assert cache.make_mask(kvcache.EXACT_MIN) == "causal"
    mask = cache.make_mask(kvcache.EXACT_MIN, return_array=True)
    assert mask.shape == (kvcache.EXACT_MIN, kvcache.EXACT_ALIGN + kvcache.EXACT_MIN)


def test_feed_refuses_nothing(loaded: Loaded) -> None:
    with pytest.raises(ValueError):
        feed(loaded.target, make_cache(loaded.target), [])


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_prompts_read_together_match_each_read_alone(
    loaded: Loaded, layout: str, request: pytest.FixtureRequest
) -> None:
    """Rows of one forward, right-padded to one width (and on the GPU to a power-of-two row
    count): each cache ends at its own prompt with the same keys, and the next token decodes
    as after a pass of that prompt alone."""
    if layout == "gpu":
        request.getfixturevalue("gpu_layout")
    mx.random.seed(7)
    lengths = [3, 17, 9]
    prompts = [to_ints(mx.random.randint(3, 200, (n + 1,))) for n in lengths]
    together = [make_cache(loaded.target) for _ in prompts]
    assert all(batchable(c) for c in together)
    feed_rows(loaded.target, together, [p[:-1] for p in prompts])
    for prompt, cache, n in zip(prompts, together, lengths, strict=True):
        alone = make_cache(loaded.target)
        feed(loaded.target, alone, prompt[:-1])
        assert cache[0].offset == alone[0].offset == n
        assert mx.allclose(cache[0].keys[..., :n, :], alone[0].keys[..., :n, :], atol=1e-4).item()
        step = [feed(loaded.target, c, prompt[-1:]) for c in (cache, alone)]
        assert mx.allclose(step[0], step[1], atol=1e-4).item()
        assert not batchable(cache)  # filled: it reads alone from here on


def test_row_shapes_recur_where_shapes_compile() -> None:
    assert row_shape(3, 17, shaped=True) == (4, 32)
    assert row_shape(8, 32, shaped=True) == (8, 32)
    assert row_shape(3, 17, shaped=False) == (3, 17)


def test_feed_rows_refuses_an_empty_prompt(loaded: Loaded) -> None:
    caches = [make_cache(loaded.target) for _ in range(2)]
    with pytest.raises(ValueError):
        feed_rows(loaded.target, caches, [[5, 6], []])


def test_only_empty_plain_kv_caches_read_together(loaded: Loaded) -> None:
    """Rotating windows and quantized caches cannot take rows of a padded forward apart; a
    filled cache (a prefix-cache hit) reads its rest alone."""
    assert batchable([KVCache(), BucketedKVCache()])
    assert not batchable([KVCache(), RotatingKVCache(max_size=64)])
    assert not batchable([QuantizedKVCache()])
    filled = make_cache(loaded.target)
    feed(loaded.target, filled, [5, 6, 7])
    assert not batchable(filled)


def test_a_long_prompt_beats_as_it_is_read(loaded: Loaded) -> None:
    """A solo request reads its whole prompt in one scheduler step: each evaluated chunk is a
    heartbeat, so the runner's watchdog never takes a long prompt for a stuck step."""
    from mlxd.engine.prefill import CHUNK
    from mlxd.engine.progress import beat_with

    beats: list[int] = []
    beat_with(lambda: beats.append(1))
    try:
        feed(loaded.target, make_cache(loaded.target), [5] * (3 * CHUNK + 64))
    finally:
        beat_with(None)
    assert len(beats) == 3  # after 1, 2 and 3 chunks
