"""Where a forward's time goes, host and device, by shape: MLX's matmuls against mlxd's kernels.

    python bench/forward_parts.py --model DIR [--shapes 1x1,1x16,8x1,...] [--context 256]

Loads the model twice as mlxd computes with it: once as it is, once with its projections
wrapped as a pairing wraps them under `MLXD_BATCH_KERNELS=1`, every forward built as a batch
builds its queued rounds (`lora_cuda.queued`: several rows x tokens of a projection's input on
mlxd's tensor-core kernel, `engine/mma_cuda.py`; one row x token on MLX's gemv). For each
shape, rows x tokens (a lone row's step 1x1 and verify 1xL, a batch's step Bx1 and verify
BxL) over a cache of `--context` keys (a batch's rows left-padded differently), it prints in
milliseconds:

- build: the Python forward that builds the graph;
- encode: `mx.async_eval` of it (on MLX's CUDA build, kernel launches and cuBLAS calls);
- alone: a forward built, encoded and waited for before the next (a verify round's shape);
- pipelined: per forward, each one built and encoded while the previous runs (plain decoding),
  and its host share.

`--thread` measures on a thread of its own, the models loaded on the main one, as the daemon's
runner threads decode.

A forward alone costs its build plus the longer of its encoding and the device's work; a
pipelined one the longer of the host's part and the device's.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()

# isort: split
import mlx.core as mx
import mlx.nn as nn

from bench.launch_cost import stages
from bench.lora_kernels import pipelined
from mlxd.engine import lora_cuda
from mlxd.engine.kvcache import batch_type, make_cache
from mlxd.engine.lora import Selection, wrap_for_decoding
from mlxd.engine.pairing import load_model
from mlxd.engine.threads import start_mlx_thread

SHAPES = "1x1,1x2,1x4,1x8,1x16,2x1,4x1,8x1,2x8,4x4,2x16"


def cache_for(model: nn.Module, rows: int, context: int) -> list[Any]:
    """A cache holding `context` keys per row, as decoding holds them: a lone row's own
    cache, or a batch cache whose rows were read with different left padding."""
    if rows == 1:
        cache = make_cache(model)
        mx.eval(model(mx.zeros((1, context), dtype=mx.uint32), cache=cache))
        return cache
    padding = [(5 * i) % 16 for i in range(rows)]
    cache = [batch_type(model)(padding) for _ in model.layers]
    mx.eval(model(mx.zeros((rows, context), dtype=mx.uint32), cache=cache))
    return cache


def forward(
    model: nn.Module, cache: list[Any], x: mx.array, kernels: bool
) -> Callable[[], list[mx.array]]:
    """A forward of x at the cache's length, taken back after (every forward sees one shape);
    with `kernels`, built as a batch builds its queued rounds (`lora_cuda.queued`)."""

    def run() -> list[mx.array]:
        with lora_cuda.queued() if kernels else nullcontext():
            out = model(x, cache=cache)
        for c in cache:
            c.trim(x.shape[1])
        return [out]

    return run


def parts(run: Callable[[], list[mx.array]], steps: int) -> tuple[float, float, float]:
    """Median (build, encode, alone) milliseconds of forwards each waited for."""
    for _ in range(3):
        mx.eval(run())
    times = [stages(run) for _ in range(steps)]
    build, encode, alone = ([t[0] for t in times], [t[1] for t in times], [sum(t) for t in times])
    return (
        1e3 * statistics.median(build),
        1e3 * statistics.median(encode),
        1e3 * statistics.median(alone),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--shapes", default=SHAPES, help="rows x tokens, comma-separated")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--thread", action="store_true", help="measure on a thread of its own")
    args = ap.parse_args()
    models = {"mlx": load_model(args.model, BACKEND)[0]}
    os.environ["MLXD_BATCH_KERNELS"] = "1"  # read when a projection is wrapped
    kernels = load_model(args.model, BACKEND)[0]
    wrapped = wrap_for_decoding(kernels, Selection())
    models["kernels"] = kernels
    mx.eval([m.parameters() for m in models.values()])  # nothing left for another thread
    print(f"device {mx.default_device()}; {args.model}; context {args.context}; "
          f"projections wrapped for the kernels: {wrapped}")  # fmt: skip
    if args.thread:  # as the daemon serves: a thread of its own, on a stream of its own

        def on_thread() -> None:
            with mx.stream(mx.new_stream(mx.default_device())):
                table(models, args)

        start_mlx_thread(on_thread, "runner-bench").join()
    else:
        table(models, args)


def table(models: dict[str, nn.Module], args: argparse.Namespace) -> None:
    print(f"{'shape':>6} {'route':>8} | {'build':>6} {'encode':>7} {'alone':>7} | "
          f"{'pipelined':>9} {'host':>6}")  # fmt: skip
    for shape in args.shapes.split(","):
        rows, tokens = (int(v) for v in shape.split("x"))
        x = mx.zeros((rows, tokens), dtype=mx.uint32)
        for name, model in models.items():
            cache = cache_for(model, rows, args.context)
            run = forward(model, cache, x, kernels=name == "kernels")
            build, encode, alone = parts(run, args.steps)
            step, host = pipelined(run, args.steps)
            print(f"{shape:>6} {name:>8} | {build:6.2f} {encode:7.2f} {alone:7.2f} | "
                  f"{step:9.2f} {host:6.2f}", flush=True)  # fmt: skip
            mx.clear_cache()


if __name__ == "__main__":
    main()
