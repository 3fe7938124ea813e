"""Logit shaping and seeded sampling shared by plain decoding, drafting and verification.

One shaping path for every consumer is what makes speculation lossless: the draft's q and the
target's p go through exactly the same penalties, top-k, temperature, top-p and min-p.

Randomness is keyed by (seed, token position), never drawn from a stream: the token at
position t is argmax(log p_t + g_t) with Gumbel noise g_t that depends only on the seed and t
(Gumbel-max: an exact sample from p_t). The draft samples position t with the same g_t, and
verification accepts a draft exactly when it equals the target's own sample there. So every
emitted token is the target's sample for its position whatever was drafted, and a seeded
request gives the same tokens alone or batched, with speculation or without, whatever draft
lengths the controller picked. Shared noise also couples draft and target: where q is close to
p, their Gumbel argmaxes agree (bench/coupling.py compares the rate with min(1, p/q)).
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from mlxd.engine.options import SamplingOptions

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: nearby (seed, position) pairs get unrelated keys."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


KEY_BLOCK = 64  # positions whose keys reach the device together


class Rng:
    """A request's randomness as a function of token position: seeded requests replay
    exactly (alone, batched, speculating or not); unseeded ones draw a fresh seed. Keys are
    built on the host a block of positions at a time, so a decode step slices a key already
    on the device instead of sending one."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        self.seed = seed & _MASK
        self._blocks: dict[int, mx.array] = {}  # block index -> (KEY_BLOCK, 2) keys

    def _seed_of(self, position: int) -> int:
        return _mix(self.seed ^ _mix(position))

    def _block(self, index: int) -> mx.array:
        block = self._blocks.get(index)
        if block is None:
            if len(self._blocks) >= 2:  # decoding moves forward: keep this block and the last
                self._blocks = {i: b for i, b in self._blocks.items() if i == index - 1}
            first = index * KEY_BLOCK
            seeds = [self._seed_of(first + i) for i in range(KEY_BLOCK)]
            pairs = [[s >> 32, s & 0xFFFFFFFF] for s in seeds]  # as `mx.random.key` lays it out
            block = self._blocks[index] = mx.array(pairs, dtype=mx.uint32)
        return block

    def key(self, position: int) -> mx.array:
        """The PRNG key of the token at `position` of the sequence (prompt included): the
        key `mx.random.key` makes of the position's seed."""
        return self._block(position // KEY_BLOCK)[position % KEY_BLOCK]

    def keys(self, position: int, count: int) -> mx.array:
        """The keys of positions position .. position + count - 1, stacked (count, 2)."""
        index, offset = divmod(position, KEY_BLOCK)
        if offset + count <= KEY_BLOCK:
            return self._block(index)[offset : offset + count]
        return mx.stack([self.key(position + i) for i in range(count)])


def gumbel_rows(keys: mx.array, vocab: int) -> mx.array:
    """One row of Gumbel noise over the vocabulary per key (a key's row is the same noise
    whatever the number of rows: one row is drawn as (1, vocab) from its key)."""
    if keys.shape[0] == 1:
        return mx.random.gumbel(shape=(1, vocab), key=keys[0])
    return mx.stack([mx.random.gumbel(shape=(vocab,), key=k) for k in keys])


def host_values(a: mx.array) -> list[Any]:
    """`a`'s values on the host, flat, read from `a` itself. A view of it (`reshape`,
    `flatten`) would be a new operation, evaluated behind whatever the device has been given
    since `a` was: a batch reads a round's tokens after queueing the next round, and reading
    them through a reshape waited for that next round too (on an H100, a batch of one's
    pipelined plain round took 9.7 ms against its bare forward's 6.1)."""
    values = a.tolist()
    if not isinstance(values, list):
        return [values]
    while values and isinstance(values[0], list):
        values = [v for row in values for v in row]  # type: ignore[union-attr]
    return values


def to_ints(a: mx.array) -> list[int]:
    """Token ids on the host (`host_values`)."""
    return [int(t) for t in host_values(a)]


def to_floats(a: mx.array) -> list[float]:
    """An array's values on the host, flat (`host_values`)."""
    return [float(t) for t in host_values(a)]


def to_int(a: mx.array) -> int:
    return int(a.item())  # type: ignore[arg-type]


def penalize(
    logits: mx.array, history: Sequence[int], extra: Sequence[int], opts: SamplingOptions
) -> mx.array:
    """Apply repeat/presence/frequency penalties to each row of `logits` (L, V).

    Row i sees the history `history + extra[:i]`, so a verify forward over drafts is penalized
    exactly as the same tokens decoded one by one would be.
    """
    if not opts.has_penalties:
        return logits
    window = opts.repeat_last_n if opts.repeat_last_n > 0 else len(history) + len(extra)
    rows = []
    for i in range(logits.shape[0]):
        seen = (list(history) + list(extra[:i]))[-window:]
        row = logits[i]
        if seen:
            counts = Counter(seen)
            ids = mx.array(list(counts.keys()))
            cnt = mx.array(list(counts.values()), dtype=row.dtype)
            sel = row[ids]
            if opts.repeat_penalty != 1.0:
                sel = mx.where(sel > 0, sel / opts.repeat_penalty, sel * opts.repeat_penalty)
            sel = sel - opts.presence_penalty - opts.frequency_penalty * cnt
            row[ids] = sel
        rows.append(row)
    return mx.stack(rows)


Shaping = tuple[float, int, float, float]  # temperature, top_k, top_p, min_p


def shaping(opts: SamplingOptions) -> Shaping:
    return (opts.temperature, opts.top_k, opts.top_p, opts.min_p)


Value = float | mx.array  # a shaping's number, or the same number held in an array
Form = tuple[int, bool, bool]  # top_k, whether top-p cuts, whether min-p cuts


def form_of(how: Shaping) -> Form:
    """What decides the operations a shaping runs (its numbers do not)."""
    _, top_k, top_p, min_p = how
    return (top_k, top_p < 1.0, min_p > 0.0)


def shaped(logits: mx.array, how: Shaping) -> mx.array:
    """The sampling distribution for each row: top-k, temperature, top-p, min-p, renormalized."""
    return _shaped(logits, form_of(how), how[0], how[2], how[3])


def _shaped(
    logits: mx.array, form: Form, temperature: Value, top_p: Value, min_p: Value
) -> mx.array:
    top_k, by_p, by_min = form
    logits = logits.astype(mx.float32)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.min(mx.topk(logits, top_k, axis=-1), axis=-1, keepdims=True)
        logits = mx.where(logits >= kth, logits, -mx.inf)
    probs = mx.softmax(logits / temperature, axis=-1)
    if by_p:
        desc = mx.sort(probs, axis=-1)[..., ::-1]
        before = mx.cumsum(desc, axis=-1) - desc
        cutoff = mx.min(mx.where(before < top_p, desc, mx.inf), axis=-1, keepdims=True)
        probs = mx.where(probs >= cutoff, probs, 0.0)
    if by_min:
        floor = min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs >= floor, probs, 0.0)
    return probs / mx.sum(probs, axis=-1, keepdims=True)


def probabilities(logits: mx.array, opts: SamplingOptions) -> mx.array:
    return shaped(logits, shaping(opts))


def sample(probs: mx.array, noise: mx.array) -> mx.array:
    """One token per row of `probs` (L, V) given its Gumbel `noise` (L, V) -> (L,) uint32."""
    return mx.argmax(mx.log(probs) + noise, axis=-1).astype(mx.uint32)


def tempered(how: Shaping) -> bool:
    """Whether the shaping is the temperature alone (no top-k, top-p or min-p cut)."""
    return _tempered(form_of(how))


def _tempered(form: Form) -> bool:
    top_k, by_p, by_min = form
    return top_k <= 0 and not by_p and not by_min


def draw(logits: mx.array, how: Shaping, noise: mx.array) -> mx.array:
    """The Gumbel-max draw of `sample(shaped(logits, how), noise)`. With the temperature alone
    the softmax is skipped: log softmax(x / T) differs from x / T by one constant per row,
    which moves no argmax, so the draw is the same exact sample for a third of the work."""
    return _draw(logits, form_of(how), how[0], how[2], how[3], noise)


def _draw(
    logits: mx.array, form: Form, temperature: Value, top_p: Value, min_p: Value, noise: mx.array
) -> mx.array:
    if _tempered(form):
        scaled = logits.astype(mx.float32) / temperature
        return mx.argmax(scaled + noise, axis=-1).astype(mx.uint32)
    return sample(_shaped(logits, form, temperature, top_p, min_p), noise)


@functools.lru_cache(maxsize=64)
def sampler(how: Shaping, compiled: bool) -> Callable[[mx.array, mx.array], mx.array]:
    """The position-keyed noise, `shaped` and `sample` as one function, compiled on a GPU: a
    sampled step is a couple dozen small operations, and launching them one by one costs more
    than computing them (mlx-lm compiles its samplers too). The shaping's numbers reach the
    compiled function as an array, so every temperature (and top-p, min-p) of one form shares
    its kernels: on MLX's CUDA build each newly compiled kernel costs a request a visible
    stall. On the CPU each new shape would cost a C++ compile for nothing. Same arithmetic
    (the same float32 numbers), same tokens."""
    core = _core(form_of(how), compiled)
    values = mx.array([how[0], how[2], how[3]], dtype=mx.float32)  # host data: any thread reads it

    def run(logits: mx.array, keys: mx.array) -> mx.array:
        return core(logits, keys, values)

    return run


@functools.lru_cache(maxsize=32)
def _core(form: Form, compiled: bool) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    def run(logits: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        noise = gumbel_rows(keys, int(logits.shape[-1]))
        return _draw(logits, form, values[0], values[1], values[2], noise)

    return mx.compile(run) if compiled else run


def choose(
    logits: mx.array,
    opts: SamplingOptions,
    rng: Rng,
    position: int,
    bias: mx.array | None = None,
) -> mx.array:
    """The token for each row of already penalized `logits` (L, V), row i sitting at
    `position` + i: the argmax when greedy, else the position-keyed sample. Lazy. A grammar's
    `bias` (L, V: 0 allowed, -inf not) masks the logits first, so the choice is the argmax or
    an exact sample of the masked distribution. The bias is added in the logits' own dtype
    (adding 0 or -inf is exact in any): masked rows then reuse the kernels unmasked rows
    compiled."""
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if opts.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return sample_keyed(logits, opts, rng.keys(position, int(logits.shape[0])))


def sample_keyed(logits: mx.array, opts: SamplingOptions, keys: mx.array) -> mx.array:
    """The sample of each row of `logits` (L, V) under its noise key (`keys`, L rows of
    `Rng.keys`), which the caller may have picked on the device. Lazy."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return sampler(shaping(opts), on_gpu)(logits, keys)


# rows of one shaping sampled in one call at most: load warms the sampler for a verify
# round's shapes, up to 16 positions (`pairing.warm_up`), which a call of as many rows reuses
ROWS_PER_CALL = 16


def choose_rows(
    logits: mx.array, opts: Sequence[SamplingOptions], key_of: Callable[[int], mx.array]
) -> mx.array:
    """Row i's token (B,) of `logits` (B, V): its argmax if its options are greedy, else its
    sample under noise key `key_of(i)` ((1, 2)). Rows of one shaping are sampled in one call,
    as a verify round's rows are: the same arithmetic row by row (so the same tokens), and on
    a GPU, where each operation is a kernel the host encodes, 8 rows of Ollama's default
    shaping took 34 kernels where one call a row took 129."""
    by_shaping: dict[Shaping | None, list[int]] = {}
    for i, o in enumerate(opts):
        by_shaping.setdefault(None if o.greedy else shaping(o), []).append(i)
    groups = [
        (how, rows[j : j + ROWS_PER_CALL])
        for how, rows in by_shaping.items()
        for j in range(0, len(rows), ROWS_PER_CALL)
    ]
    on_gpu = mx.default_device().type == mx.DeviceType.gpu

    def pick(how: Shaping | None, rows: list[int], x: mx.array) -> mx.array:
        if how is None:
            return mx.argmax(x, axis=-1).astype(mx.uint32)
        return sampler(how, on_gpu)(x, mx.concatenate([key_of(i) for i in rows]))

    if len(groups) == 1:
        how, rows = groups[0]
        return pick(how, rows, logits)
    parts, order = [], []
    for how, rows in groups:
        parts.append(pick(how, rows, logits[mx.array(rows)]))
        order += rows
    back = sorted(range(len(order)), key=order.__getitem__)  # where each row's token landed
    return mx.concatenate(parts)[mx.array(back)]


def next_tokens(
    logits: mx.array,
    history: Sequence[int],
    extra: Sequence[int],
    opts: SamplingOptions,
    rng: Rng,
    position: int,
    bias: mx.array | None = None,
) -> mx.array:
    """Choose one token per row of `logits` (the first at `position`); penalties see
    `history + extra`; a grammar's `bias` masks them."""
    return choose(penalize(logits, history, extra, opts), opts, rng, position, bias)
