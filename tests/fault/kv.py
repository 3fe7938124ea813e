"""A real model's K/V through the prefix cache, for the kill -9 campaign.

Run as a module it is the writer that gets killed: it prefills prompt after prompt on a tiny
model and offers each to a PrefixCache on the given directory, printing how many prompts are
flushed to SSD as it goes (`python -m tests.fault.kv MODEL_DIR CACHE_DIR FIRST_PROMPT`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxd.engine.cache_use import offer_caches
from mlxd.engine.prefix_cache import DEFAULT_BLOCK, Namespace, PrefixCache

NS = Namespace(model="fault-kill")
PROMPT_BLOCKS = 3
PROMPTS = 400


def prompt(i: int) -> list[int]:
    """Three full blocks and a few tokens, deterministic in `i`; prompts share no blocks."""
    rng = random.Random(7_000 + i)
    return [rng.randrange(6, 380) for _ in range(PROMPT_BLOCKS * DEFAULT_BLOCK + 5)]


def load_model(model_dir: Path) -> Any:
    model, _ = load(str(model_dir))
    return model


def prefill(model: Any, tokens: list[int]) -> list[Any]:
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def greedy(model: Any, caches: list[Any], rest: list[int], n: int = 8) -> list[int]:
    """`n` greedy tokens after feeding `rest` to caches that hold what comes before it."""
    logits = model(mx.array(rest)[None], cache=caches)
    out: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=caches)
    return out


def main(model_dir: str, cache_dir: str, first: int) -> None:
    model = load_model(Path(model_dir))
    cache = PrefixCache(1 << 20, Path(cache_dir), 1 << 30)  # tiny RAM: everything goes to SSD
    assert cache.ssd is not None
    print("ready", flush=True)
    for i in range(first, PROMPTS):
        tokens = prompt(i)
        offer_caches(cache, NS, prefill(model, tokens), tokens)
        if i % 2 == 1:
            cache.ssd.flush()
            print(i + 1, flush=True)  # prompts [0, i] are on disk
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
