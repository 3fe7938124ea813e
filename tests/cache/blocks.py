"""Deterministic K/V blocks for the prefix-cache tests (importable by a writer subprocess)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from mlxd.engine.prefix_cache import DEFAULT_BLOCK, Block, Namespace, block_keys

BLOCK = DEFAULT_BLOCK


def make_block(seed: int, layers: int = 2, tokens: int = BLOCK, head_dim: int = 16) -> Block:
    """A float32 block whose content follows from `seed` alone."""
    rng = np.random.default_rng(seed)
    arrays = [
        [mx.array(rng.standard_normal((1, 2, tokens, head_dim)).astype(np.float32)) for _ in "kv"]
        for _ in range(layers)
    ]
    return Block(["kv"] * layers, arrays)


def chain(n_blocks: int, seed: int = 0) -> list[int]:
    """`n_blocks` full blocks of deterministic token ids."""
    rng = random.Random(seed)
    return [rng.randrange(6, 384) for _ in range(n_blocks * BLOCK)]


KILL_NS = Namespace(model="kill-9")
KILL_BLOCKS = 2000
KILL_SEED = 9


def kill_tokens() -> list[int]:
    return chain(KILL_BLOCKS, seed=KILL_SEED)


def kill_keys() -> list[str]:
    return block_keys(kill_tokens(), KILL_NS, BLOCK)


def kill_block(i: int) -> Block:
    """Even blocks are large (diskcache keeps them as files), odd ones small (in its database)."""
    return make_block(10_000 + i, layers=2, tokens=BLOCK if i % 2 == 0 else 8, head_dim=32)
