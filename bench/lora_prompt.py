"""A prompt's forward on an adapter against the base's, by route of the adapters' terms.

    python bench/lora_prompt.py [--model DIR] [--lengths 16,64,512,2048] [--repeats 5]
                                [--layers 16]

Trains adapters as `bench/adapters.py` trains its four (mlx-lm's tuner, rank 8, scale 20,
every projection of the last `--layers` blocks; kept in the same work folder, so the two
benches share them), mounts it on `--model` through the engine's `AdapterSet`, and times, per
prompt length, one whole forward of a lone row into a fresh cache (evaluated, median of
`--repeats` after one untimed) three ways:

- `base`: the model with no adapter selected;
- `direct`: the adapter's term as its own matrices (`x @ A`, then `addmm`), what a forward of
  rows all on one adapter takes from `lora.DIRECT_TOKENS` tokens a row;
- `gathered`: what rows of several adapters take: on a GPU, x A for every mounted adapter in
  one matmul, the row's own columns, then a `gather_mm` by sB (two `gather_mm`s on a CPU);

and the same prompt as two rows, on the base and on two adapters (one each: the route several
prompts read together in one forward take), to their own base.

Prints milliseconds and each adapted route's ratio to the base: a prompt's terms should cost
a few percent of its forward, whichever route they take.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

# isort: split
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from bench.adapters import MODEL, WORKDIR, train
from mlxd.engine import lora
from mlxd.engine.adapters import AdapterSet, selecting
from mlxd.registry.schema import AdapterRef


def timed(forward: Callable[[mx.array, Any], mx.array], model: Any, tokens: mx.array,
          repeats: int) -> float:  # fmt: skip
    """Median ms of one forward of `tokens` into a fresh cache, after one untimed."""
    times = []
    for i in range(repeats + 1):
        cache = make_prompt_cache(model)
        mx.eval([c.state for c in cache if c.state])
        t0 = time.perf_counter()
        mx.eval(forward(tokens, cache))
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--workdir", type=Path, default=WORKDIR)
    ap.add_argument("--lengths", default="16,64,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16, help="adapted blocks, from the last")
    args = ap.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    paths = train(args.model, args.workdir, args.layers)[:2]
    model, _ = load(str(args.model))
    adapters = AdapterSet(model)
    view, other = (adapters.acquire([AdapterRef(str(p))]) for p in paths)
    direct = lora.DIRECT_TOKENS

    def gathered(tokens: mx.array, cache: Any) -> mx.array:
        lora.DIRECT_TOKENS = 1 << 30
        try:
            return view(tokens, cache=cache)
        finally:
            lora.DIRECT_TOKENS = direct

    def two_adapters(tokens: mx.array, cache: Any) -> mx.array:
        with selecting([view, other]):
            return model(tokens, cache=cache)

    routes: dict[str, Callable[[mx.array, Any], mx.array]] = {
        "base": lambda t, c: model(t, cache=c),
        "direct": lambda t, c: view(t, cache=c),
        "gathered": gathered,
    }
    pairs: dict[str, Callable[[mx.array, Any], mx.array]] = {
        "base": lambda t, c: model(t, cache=c),
        "two": two_adapters,
    }
    print(f"model {args.model}  adapted blocks {args.layers}  device {mx.default_device()}")
    print(f"{'tokens':>7} {'base ms':>9} {'direct ms':>10} {'ratio':>6} {'gathered ms':>12}"
          f" {'ratio':>6} | {'2 rows: base':>12} {'2 adapters':>11} {'ratio':>6}")  # fmt: skip
    try:
        for length in [int(n) for n in args.lengths.split(",")]:
            tokens = mx.random.randint(0, 1000, (1, length), key=mx.random.key(length))
            ms = {name: timed(f, model, tokens, args.repeats) for name, f in routes.items()}
            both = mx.concatenate([tokens, tokens])
            two = {name: timed(f, model, both, args.repeats) for name, f in pairs.items()}
            base = ms["base"]
            print(
                f"{length:>7} {base:>9.2f} {ms['direct']:>10.2f} {ms['direct'] / base:>6.2f}"
                f" {ms['gathered']:>12.2f} {ms['gathered'] / base:>6.2f} |"
                f" {two['base']:>12.2f} {two['two']:>11.2f} {two['two'] / two['base']:>6.2f}",
                flush=True,
            )
    finally:
        adapters.release(view)
        adapters.release(other)


if __name__ == "__main__":
    main()
