"""Where a batch's plain round spends what a lone row's step does not.

    python bench/batch_parts.py [--model DIR | --shape 8b] [--tokens 128]

A lone row's step and a batch of one run the same matmuls, yet on a GPU the batch's round
cost more (fat 7B-shaped target, H100: 9.74 ms against its bare forward's 6.12, until a
batch's reads stopped waiting for the round it queued after them; 8.21 against 7.69 after,
on another start). Pipelined steps (each queued before the previous one's token is read) are
built ever closer to a batch's plain round: bare forwards over a lone row's cache, over a
batch cache of that row, over the cache of a `RowBatch` its `Generation` joined; then
through the batch's own forward and choice; then its whole rounds; the same at 8 rows. Each
step's host time is split into building the graph, encoding it (`mx.async_eval`) and
waiting for the token before it: where the wait is near zero the host is the bound. (A lone
row's steps read their token inside `Generation._lean_step`: their wait counts as building.)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import SHAPES
from bench.rows import ROOT, as_served, build, mlxd_rate, prompts_for

# isort: split
import mlx.core as mx

from mlxd.engine import batch as batch_module
from mlxd.engine import generation
from mlxd.engine.batch import RowBatch
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import batch_type, make_cache
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs

GREEDY = parse_options({"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 1})


def forwards(model: Any, tokens: int) -> None:
    """Forwards each queued before the previous one's token is read, built ever closer to a
    batch's plain round: bare over a lone row's cache and a batch's, through the batch's own
    forward and choice, then its whole rounds. Splits each step's host time into building
    the graph, encoding it (`mx.async_eval`) and waiting for the token before."""
    vocab = model.args.vocab_size

    def rows(count: int) -> RowBatch:
        gens = [Generation(model, p, GREEDY, set(), 10**6, Rng(i)) for i, p in
                enumerate(prompts_for(count, vocab))]  # fmt: skip
        for g in gens:
            g.prefill()
        batch = RowBatch(model, Costs(verify={1: 1.0}))
        batch.join(gens)
        return batch

    def lone() -> list[Any]:
        cache = make_cache(model)
        prompt = mx.array(prompts_for(1, vocab)[0], dtype=mx.uint32)[None]
        mx.eval(model(prompt, cache=cache))
        return cache

    def bare(cache: list[Any]) -> Callable[[mx.array], mx.array]:
        return lambda y: mx.argmax(model(y[:, None], cache=cache)[:, -1, :], -1).astype(mx.uint32)

    def batchs(batch: RowBatch) -> Callable[[mx.array], mx.array]:
        return lambda y: batch._choose(batch._forward(y[:, None], queued=True), [1] * len(y))

    def split(step: Callable[[mx.array], mx.array], count: int) -> tuple[float, ...]:
        y = step(mx.array([5] * count, dtype=mx.uint32))
        mx.async_eval(y)
        build = encode = wait = 0.0
        t0 = time.perf_counter()
        for _ in range(tokens):
            a = time.perf_counter()
            nxt = step(y)
            b = time.perf_counter()
            mx.async_eval(nxt)
            c = time.perf_counter()
            y.tolist()
            build, encode, wait = build + b - a, encode + c - b, wait + time.perf_counter() - c
            y = nxt
        y.tolist()
        total = time.perf_counter() - t0
        return tuple(1e3 * x / tokens for x in (total, build, encode, wait))

    def rounds(count: int) -> tuple[float, ...]:
        """A batch's rounds (a lone row's steps at count 0), the time in MLX's encoding and in
        reading tokens counted where the engine calls them."""
        spent = {"encode": 0.0, "wait": 0.0}

        def counted(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    spent[key] += time.perf_counter() - t

            return call

        saved = mx.async_eval, batch_module.to_ints, generation.to_int
        if count:
            batch = rows(count)
            step: Callable[[], Any] = batch.round
        else:
            gen = Generation(model, prompts_for(1, vocab)[0], GREEDY, set(), 10**6, Rng(0))
            gen.prefill()
            step = gen.step
        step()
        mx.async_eval = counted(mx.async_eval, "encode")
        batch_module.to_ints = counted(batch_module.to_ints, "wait")
        generation.to_int = counted(generation.to_int, "wait")
        try:
            t0 = time.perf_counter()
            for _ in range(tokens):
                step()
            total = time.perf_counter() - t0
        finally:
            mx.async_eval, batch_module.to_ints, generation.to_int = saved
        if count:
            batch.drop_ahead()
        mx.synchronize()
        encode, wait = spent["encode"], spent["wait"]
        return tuple(1e3 * x / tokens for x in (total, total - encode - wait, encode, wait))

    cells: dict[str, Callable[[], tuple[float, ...]]] = {
        "lone row's steps": lambda: rounds(0),
        "lone cache": lambda: split(bare(lone()), 1),
        "batch cache": lambda: split(bare([batch_type(model).merge([c]) for c in lone()]), 1),
        "batch's cache": lambda: split(bare(rows(1).cache), 1),
        "batch's forward": lambda: split(batchs(rows(1)), 1),
        "batch's rounds": lambda: rounds(1),
        "8: batch's cache": lambda: split(bare(rows(8).cache), 8),
        "8: batch's forward": lambda: split(batchs(rows(8)), 8),
        "8: batch's rounds": lambda: rounds(8),
    }
    print("forwards: ms per pipelined step (greedy)")
    print(f"  {'':<20} {'step':>6} {'build':>6} {'encode':>6} {'wait':>6}")
    for name, cell in cells.items():
        cell()
        print(f"  {name:<20} " + " ".join(f"{x:6.2f}" for x in cell()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=ROOT.parent / "shared/models/code-pair/target")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model = build(args)
    as_served(model)
    mlxd_rate(model, prompts_for(2, model.args.vocab_size), 8, 0.0)
    print(f"device {mx.default_device()}")
    forwards(model, args.tokens)


if __name__ == "__main__":
    main()
