"""A bucketed batch cache's key buffer is always a whole number of buckets, so multi-token
forwards over it (verify rounds, draft catch-ups) see recurring key lengths, and every row
still computes what it computes alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from mlxd.engine.draftbatch import trim_rows
from mlxd.engine.kvcache import BucketedBatchKVCache, BucketedKVCache, bucketed_type
from mlxd.engine.smallarrays import MIN_BYTES

STEP = 8
CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
    "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip


def model() -> nn.Module:
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    mx.eval(m.parameters())
    return m


class Rows:
    """A batch of rows and each row's own cache beside it, fed the same tokens."""

    def __init__(self, m: nn.Module, prompts: list[list[int]]) -> None:
        self.m = m
        kind = bucketed_type(STEP)
        self.solo = [[kind() for _ in m.layers] for _ in prompts]
        for cache, prompt in zip(self.solo, prompts, strict=True):
            mx.eval(m(mx.array([prompt]), cache=cache))
        self.batch = [kind.merge([c[i] for c in self.solo]) for i in range(len(m.layers))]

    def step(self, tokens: list[list[int]]) -> None:
        """Feed row i `tokens[i]` (one width for all rows) and compare each row with its own."""
        got = self.m(mx.array(tokens), cache=self.batch)
        for i, cache in enumerate(self.solo):
            want = self.m(mx.array([tokens[i]]), cache=cache)
            # float32 matmuls of other shapes round differently on a GPU (5e-4 seen on an
            # H200); a wrong mask or roll moves outputs by orders of magnitude more
            assert mx.allclose(got[i], want[0], atol=2e-3).item(), i
        self.check()

    def check(self) -> None:
        for c in self.batch:
            assert c.keys.shape[2] % STEP == 0, c.keys.shape
            assert c.keys.shape == c.values.shape


def test_rows_merge_grow_and_take_verify_widths_in_whole_buckets() -> None:
    rows = Rows(model(), [[1, 2, 3, 4, 5], [6] * 11, [7, 8]])
    rows.check()
    assert rows.batch[0].keys.shape[2] == 16  # the longest row, 11 keys, in buckets of 8
    for _ in range(3):
        rows.step([[9, 10, 11, 12, 13]] * 3)  # a verify-wide forward, past a bucket's end
    rows.step([[14]] * 3)
    assert rows.batch[0].keys.shape[2] == 32


def test_rows_that_join_and_leave_keep_whole_buckets() -> None:
    m = model()
    rows = Rows(m, [[1, 2, 3], [4] * 9])
    more = Rows(m, [[5] * 20])
    for mine, new in zip(rows.batch, more.batch, strict=True):
        mine.extend(new)
    rows.solo += more.solo
    rows.check()
    rows.step([[6, 7]] * 3)
    # the longest row (20 + 2 keys) leaves: the others share 11 positions of left padding,
    # so one whole bucket of it goes
    end = rows.batch[0]._idx
    keep = mx.array([0, 1])
    for c in rows.batch:
        c.filter(keep, end - 11)
    rows.solo = rows.solo[:2]
    assert rows.batch[0].keys.shape[2] == 24 - STEP and rows.batch[0]._idx == end - STEP
    rows.step([[8, 9, 10]] * 2)


def test_rows_trimmed_by_different_amounts_keep_whole_buckets() -> None:
    m = model()
    rows = Rows(m, [[1] * 4, [2] * 30])
    rows.step([[3, 4, 5, 6, 7]] * 2)
    trim_rows(rows.batch, [1, 4], 2)  # row 0 keeps 4 of the 5, row 1 keeps 1
    for cache, n in zip(rows.solo, [1, 4], strict=True):
        for c in cache:
            c.trim(n)
    rows.check()
    rows.step([[8]] * 2)
    assert isinstance(rows.solo[0][0], BucketedKVCache)


def test_rows_with_nothing_cached_merge_into_a_bucketed_batch() -> None:
    kind = bucketed_type(STEP)
    merged = kind.merge([kind(), kind()])
    assert type(merged) is kind.batch
    k = mx.zeros((2, 2, 3, 8))
    keys, _ = merged.update_and_fetch(k, k)
    assert keys.shape[2] == STEP


def test_one_or_two_rows_keep_their_offsets_and_padding_out_of_the_scalar_pool() -> None:
    """MLX's CUDA allocator puts every array of 8 bytes or less, a kernel's output too, in one
    pool of managed memory. A batch's offsets and left padding (every layer's RoPE and
    attention read them, every layer's update rewrites them) are views of buffers of at
    least MIN_BYTES through each change a round makes, with 1 and 2 rows as well, where
    (rows,) int32 takes 4 or 8 bytes; each row still computes what it computes alone."""
    m = model()
    for prompts in ([[1, 2, 3]], [[1, 2, 3], [4] * 9]):
        rows = Rows(m, prompts)
        n = len(prompts)

        def held(rows: Rows = rows, n: int = n) -> None:
            for c in rows.batch:
                for name in ("offset", "left_padding"):
                    buffer, view = c.__dict__[name]  # the per-row array's buffer and view
                    assert buffer.nbytes >= MIN_BYTES, (name, buffer.shape)
                    assert getattr(c, name) is view and view.shape == (n,)

        held()
        rows.step([[5, 6, 7]] * n)
        held()
        amounts = [1, 2][:n]  # with two rows: one trimmed off the end, one rolled
        trim_rows(rows.batch, amounts, n)
        for cache, k in zip(rows.solo, amounts, strict=True):
            for c in cache:
                c.trim(k)
        held()
        rows.step([[8]] * n)
        dropped = [1, 0][:n]  # counts the host has not read (a verify round's rejections)
        BucketedBatchKVCache.drop_unread(rows.batch, mx.array(dropped))
        for cache, k in zip(rows.solo, dropped, strict=True):
            for c in cache:
                c.trim(k)
        held()
        rows.step([[9, 10]] * n)
        held()
