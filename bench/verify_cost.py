"""Verify-forward cost at fresh cache lengths: mlx-lm's KVCache vs mlxd's bucketed cache.

    python bench/verify_cost.py --model ../shared/models/code-pair/target

Each width L is timed as a run of L-token forwards that advance the cache (so every forward
lands on a cache length never seen before, as verify rounds do), relative to one-token decoding.
Each forward is evaluated before the next is built, as a lone row's verify round is: its time is
the host's building and encoding plus the device's.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()  # as `mlxd serve` does (on CUDA: MLX's graphs off)

# isort: split
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.kvcache import GPU_BUCKET, make_cache, set_bucket


def per_forward(model: object, cache: list[object], width: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        x = mx.zeros((1, width), dtype=mx.uint32)
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))  # type: ignore[operator]
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--widths", default="1,2,3,4,5,6,7,8,9")
    args = ap.parse_args()
    model = load(str(args.model))[0]
    set_bucket(model, GPU_BUCKET)  # mlxd's GPU layout, on whatever device this runs
    widths = [int(w) for w in args.widths.split(",")]
    print(
        f"device {mx.default_device()}; ms per forward at fresh cache lengths (context {args.context})"
    )
    print(f"{'cache':<10}" + "".join(f"{'L=' + str(w):>9}" for w in widths))
    for name, factory in (("mlx-lm", make_prompt_cache), ("mlxd", make_cache)):
        cache = factory(model)
        mx.eval(model(mx.zeros((1, args.context), dtype=mx.uint32), cache=cache))
        per_forward(model, cache, 1, 3)
        times = [per_forward(model, cache, w, args.reps) for w in widths]
        print(f"{name:<10}" + "".join(f"{t * 1e3:>9.2f}" for t in times))
        print(f"{'  v(L)':<10}" + "".join(f"{t / times[0]:>9.2f}" for t in times))


if __name__ == "__main__":
    main()
