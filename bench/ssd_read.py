"""SSD tier reads: the hardened store against plain diskcache on the same rows, side by side.

    python bench/ssd_read.py [--sizes 32K,1M,8M] [--blocks 32] [--reps 7]

Writes `--blocks` blocks of each size with `SsdTier`, then reads every block back, repetition
after repetition, alternately through `SsdTier.get` (str keys and bytes only, value files
checked to lie inside the directory and opened without following symlinks, the checksum
verified, the block decoded) and through a plain `diskcache.Cache` on the same directory with
the same settings (pickle-capable, trusting the row) followed by the same `decode`. Both read
from the page cache; the ratio is what the hardening costs per block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import diskcache
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.prefix_cache import Block, SsdTier, decode

UNITS = {"K": 2**10, "M": 2**20}


def block_of(nbytes: int, seed: int) -> Block:
    """Two layers of float16 K/V, `nbytes` in all."""
    per = nbytes // 4 // 2  # 4 arrays of float16
    head_dim = 128
    tokens = max(1, per // head_dim)
    rng = np.random.default_rng(seed)
    arrays = [
        [mx.array(rng.standard_normal((1, 1, tokens, head_dim)).astype(np.float16)) for _ in "kv"]
        for _ in range(2)
    ]
    return Block(["kv", "kv"], arrays)


def timed(fn: object, keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        got = fn(key)  # type: ignore[operator]
        assert got is not None
        mx.eval([a for layer in got.arrays for a in layer])
    return (time.perf_counter() - start) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32K,1M,8M")
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"{'block':>6} {'hardened ms':>12} {'plain ms':>9} {'ratio':>6}")
    for size in args.sizes.split(","):
        nbytes = int(size[:-1]) * UNITS[size[-1]]
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp) / "ssd"
            tier = SsdTier(directory, 64 * 2**30)
            keys = [f"{i:064x}" for i in range(args.blocks)]
            for i, key in enumerate(keys):
                tier.put_async(key, block_of(nbytes, i))
            tier.flush()
            plain = diskcache.Cache(
                str(directory), size_limit=64 * 2**30, eviction_policy="least-recently-used",
                cull_limit=16, statistics=False,
            )  # fmt: skip

            def plain_get(key: str, plain: diskcache.Cache = plain) -> Block | None:
                return decode(key, plain.get(key))

            hardened, trusting = [], []
            for rep in range(args.reps):  # alternate which goes first
                if rep % 2:
                    trusting.append(timed(plain_get, keys))
                hardened.append(timed(tier.get, keys))
                if not rep % 2:
                    trusting.append(timed(plain_get, keys))
            plain.close()
            tier.close()
        h, p = statistics.median(hardened) * 1e3, statistics.median(trusting) * 1e3
        print(f"{size:>6} {h:12.3f} {p:9.3f} {h / p:6.2f}")


if __name__ == "__main__":
    main()
