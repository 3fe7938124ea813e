"""The sampler (compiled on a GPU) draws exactly the tokens the reference arithmetic draws."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine import sampling
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import (
    Rng,
    choose,
    choose_rows,
    gumbel_rows,
    sample,
    sampler,
    shaped,
    shaping,
    to_floats,
    to_ints,
)

SHAPINGS = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.3, "top_k": 5, "top_p": 0.8},
    {"temperature": 1.3, "top_k": 0, "top_p": 0.95, "min_p": 0.05},
]


@pytest.mark.parametrize("options", SHAPINGS)
@pytest.mark.parametrize("rows", [1, 4])
def test_compiled_sampling_matches_the_reference(options: dict[str, float], rows: int) -> None:
    opts = parse_options(options)
    rng = Rng(1234)
    mx.random.seed(rows)
    for position in range(0, 200, 7):
        logits = mx.random.normal((rows, 97)) * 3
        keys = rng.keys(position, rows)
        want = sample(shaped(logits, shaping(opts)), gumbel_rows(keys, 97))
        got = choose(logits, opts, rng, position)
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("rows", [1, 3])
def test_the_compiled_sampler_matches_the_reference(rows: int) -> None:
    """What a GPU runs, compiled here (on the CPU each shape is a C++ compile: one shaping)."""
    how = shaping(parse_options({"temperature": 0.8, "top_k": 7, "top_p": 0.9, "min_p": 0.02}))
    rng = Rng(99)
    compiled = sampler(how, True)
    for position in range(0, 60, 6):
        logits = mx.random.normal((rows, 97), key=mx.random.key(position)) * 3
        keys = rng.keys(position, rows)
        want = sample(shaped(logits, how), gumbel_rows(keys, 97))
        assert compiled(logits, keys).tolist() == want.tolist()


@pytest.mark.parametrize("cut", [{}, {"top_k": 0, "top_p": 1.0}], ids=["shaped", "tempered"])
def test_a_position_draws_the_same_token_alone_or_inside_a_wider_round(
    cut: dict[str, float],
) -> None:
    """Row i of a verify round samples position p + i exactly as a one-row step at p + i
    (one row's noise is drawn without stacking, the temperature alone without a softmax)."""
    opts = parse_options({"temperature": 0.9, "seed": 3, **cut})
    rng = Rng(3)
    logits = mx.random.normal((5, 64), key=mx.random.key(0)) * 2
    wide = choose(logits, opts, rng, 40).tolist()
    alone = [choose(logits[i : i + 1], opts, rng, 40 + i).tolist()[0] for i in range(5)]
    assert wide == alone


def test_keys_are_the_positions_own_whatever_block_they_come_from() -> None:
    """A key sliced from a block of keys is `mx.random.key` of its position's seed, read
    one at a time, several at once, across a block's end and going back after a rollback."""
    rng = Rng(2**62 + 12345)
    want = {p: mx.random.key(rng._seed_of(p)).tolist() for p in range(0, 300)}
    for p in (0, 5, 63, 64, 200, 130, 7):
        assert rng.key(p).tolist() == want[p]
    for p, n in ((60, 9), (0, 64), (127, 2), (250, 5), (3, 1)):
        assert rng.keys(p, n).tolist() == [want[p + i] for i in range(n)]


def test_one_compiled_sampler_serves_every_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shaping's numbers are inputs of the compiled function: a new temperature reuses the
    kernels another compiled (it is traced once), and draws what the reference draws."""
    traced = []
    real = sampling._draw

    def counting(*args: object) -> mx.array:
        traced.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "_draw", counting)
    sampling._core.cache_clear()
    sampler.cache_clear()
    rng = Rng(5)
    logits = mx.random.normal((1, 97), key=mx.random.key(1)) * 3
    for temperature in (0.7, 0.9, 1.3):
        how = shaping(parse_options({"temperature": temperature, "top_k": 0, "top_p": 1.0}))
        got = sampler(how, True)(logits, rng.keys(8, 1))
        want = sample(shaped(logits, how), gumbel_rows(rng.keys(8, 1), 97))
        assert got.tolist() == want.tolist()
    assert len(traced) == 1


@pytest.mark.parametrize("options", [{"temperature": 0}, SHAPINGS[0], SHAPINGS[1]])
def test_a_mask_chooses_the_same_in_the_logits_dtype(options: dict[str, float]) -> None:
    """A grammar's bias added to bf16 logits chooses what it chooses added in float32."""
    opts = parse_options(options)
    rng = Rng(8)
    logits = (mx.random.normal((3, 97), key=mx.random.key(2)) * 3).astype(mx.bfloat16)
    bias = mx.where(mx.arange(97) % 3 == 0, 0.0, -mx.inf)[None].astype(mx.float32)
    bias = mx.broadcast_to(bias, (3, 97))
    wide = logits.astype(mx.float32) + bias
    if opts.greedy:
        want = mx.argmax(wide, axis=-1).astype(mx.uint32)
    else:
        want = sample(shaped(wide, shaping(opts)), gumbel_rows(rng.keys(30, 3), 97))
    assert choose(logits, opts, rng, 30, bias).tolist() == want.tolist()
    assert all(t % 3 == 0 for t in want.tolist())


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-40, "top_k": 3},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1e-300, "repeat_penalty": 1e-300, "repeat_last_n": 0},
    ],
    ids=["temperature", "temperature-top-k", "top-p", "penalty"],
)
def test_vanishing_values_sample_the_most_likely_token(options: dict[str, float]) -> None:
    """A positive temperature or top-p far below float32's range is floored, not divided by as
    0: the draw is the argmax, as the limit of the distribution says (before the floor, such
    requests drew a token from logits that were all infinite or all cut)."""
    opts = parse_options(options)
    rng = Rng(5)
    mx.random.seed(3)
    for position in range(0, 60, 6):
        logits = mx.random.normal((2, 97)) * 3
        got = choose(logits, opts, rng, position)
        assert got.tolist() == mx.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize(("compiled", "per_call"), [(False, 16), (True, 16), (False, 2)])
def test_a_batchs_rows_take_the_tokens_each_takes_alone(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, per_call: int
) -> None:
    """Rows of greedy and mixed shapings, each at its own position with its own seed: each
    row's token is the one it draws alone, and rows of one shaping take one sampler call
    (of `ROWS_PER_CALL` rows at most: the shapes load warms)."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu if compiled else mx.cpu))
    monkeypatch.setattr(sampling, "ROWS_PER_CALL", per_call)
    calls: list[int] = []
    real = sampling.sampler

    def counted(how: sampling.Shaping, on_gpu: bool):  # type: ignore[no-untyped-def]
        run = real(how, on_gpu)

        def call(logits: mx.array, keys: mx.array) -> mx.array:
            calls.append(int(logits.shape[0]))
            return run(logits, keys)

        return call

    monkeypatch.setattr(sampling, "sampler", counted)
    kinds = [{"temperature": 0}, *SHAPINGS, {"temperature": 0.7}, {"temperature": 0.7}]
    opts = [parse_options(k) for k in kinds]
    rngs = [Rng(100 + i) for i in range(len(opts))]
    positions = [3 + 5 * i for i in range(len(opts))]
    mx.random.seed(9)
    for trial in range(12):
        logits = mx.random.normal((len(opts), 97)) * 3
        calls.clear()
        got = choose_rows(logits, opts, lambda i, t=trial: rngs[i].keys(positions[i] + t, 1))
        # the three rows of {"temperature": 0.7} in one call, or in two of 2 and 1
        assert sorted(calls) == ([1, 1, 1, 3] if per_call > 2 else [1, 1, 1, 1, 2])
        alone = [
            choose(logits[i : i + 1], o, r, p + trial).item()
            for i, (o, r, p) in enumerate(zip(opts, rngs, positions, strict=True))
        ]
        assert got.tolist() == alone


def test_host_values_read_any_shape_flat() -> None:
    grid = mx.array([[[1, 2], [3, 4]], [[5, 6], [7, 8]]], dtype=mx.uint32)
    assert to_ints(grid) == list(range(1, 9))
    assert to_ints(mx.array(7, dtype=mx.int32)) == [7]
    assert to_ints(mx.array([], dtype=mx.uint32)) == []
    assert to_ints(mx.zeros((2, 0), dtype=mx.uint32)) == []
    assert to_floats(mx.array([[0.5], [1.5]])) == [0.5, 1.5]
