"""Adapted projections of a decode step, by route: how each way of adding the terms costs.

    python bench/lora_kernels.py [--blocks 16] [--rows 1,8] [--steps 60] [--shapes 2x2,4x2]

On MLX's CUDA build, for a 7B-shaped bf16 block (q, k, v; o; gate, up; down) with four rank-8
adapters, times pipelined steps of `--blocks` blocks' projections (each step's outputs evaluated
while the next is built, as decoding does) for rows x 1 token, every row adapted (rows on
different adapters), by route:

- `base`: MLX's matmuls alone, no terms (what a step on the base costs);
- `gather`: the base matmuls plus two `gather_mm`s and an add per projection (the MLX ops);
- `bare`: `lora_cuda`'s project kernel (a lone row) or tensor-core kernel (several rows)
  without terms: how fast the kernels read W against MLX's matmuls;
- `project`: `lora_cuda`'s down and project kernels, one call per group of one input;
- `project, idx pooled`: the same with the rows' slot index where MLX's CUDA allocator puts
  arrays of 8 bytes or less (`engine.smallarrays`);
- `matmul+down+up`: MLX's matmuls for x W^T, then a `down` and an `up` launch per group;
- `matmul+term`: MLX's matmuls, then one `term` launch per group.

`--shapes CxU,...` adds a `project CxU` route per shape: the project kernel with C columns a
warp and U 16-byte pieces a column in flight, in place of `lora_cuda.SHAPES` (which a lone
row's reading of W at about half the memory's speed is tuned by; C x rows <= 32).

Prints milliseconds per step, the host's share of it and each route's ratio to `base`. `lora_cuda` sends a lone row
through `project` and several through `matmul+down+up` (`MATMUL_ROWS`): those should be the
cheapest at their row counts.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

# isort: split
import mlx.core as mx

from mlxd.engine import lora_cuda
from mlxd.engine.attention import cuda_available
from mlxd.engine.smallarrays import kernel_array

HIDDEN, KV, MLP, RANK, SLOTS = 3584, 512, 18944, 8, 5
GROUPS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)),
          "mlp": (HIDDEN, (MLP, MLP)), "down": (MLP, (HIDDEN,))}  # fmt: skip


def rand(*shape: int) -> mx.array:
    return (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)


def block() -> dict[str, list[lora_cuda.Part]]:
    """One block's projections, each with SLOTS-1 adapters (slot 0 zeros, as mounted)."""
    return {
        name: [lora_cuda.Part(rand(SLOTS, RANK, k), rand(n, k), rand(SLOTS, n, RANK), None)
               for n in outs]
        for name, (k, outs) in GROUPS.items()
    }  # fmt: skip


Route = Callable[[mx.array, mx.array, list[lora_cuda.Part]], list[mx.array]]


def base(x: mx.array, idx: mx.array, parts: list[lora_cuda.Part]) -> list[mx.array]:
    return [x @ p.weight.T for p in parts]


def gather(x: mx.array, idx: mx.array, parts: list[lora_cuda.Part]) -> list[mx.array]:
    rows = mx.arange(x.shape[0], dtype=mx.uint32)
    out = []
    for p in parts:
        assert p.at is not None and p.bt is not None
        h = mx.gather_mm(x, p.at.swapaxes(1, 2), rows, idx)
        out.append(x @ p.weight.T + mx.gather_mm(h, p.bt.swapaxes(1, 2), rows, idx))
    return out


def kernels(term: bool = True, **choice: Any) -> Route:
    compiled = mx.compile(partial(lora_cuda._project, bias=False, term=term, **choice))

    def route(x: mx.array, idx: mx.array, parts: list[lora_cuda.Part]) -> list[mx.array]:
        if not term:
            return list(compiled(x, *(p.weight for p in parts)))
        flat = [a for p in parts for a in (p.weight, p.at, p.bt) if a is not None]
        return list(compiled(x, idx, *flat))

    return route


def pooled(route: Route) -> Route:
    """`route` given idx as a plain array: of one or two rows, MLX's CUDA allocator places it
    in its pool of read-mostly managed memory, which `smallarrays.kernel_array` avoids."""
    held: dict[int, mx.array] = {}

    def call(x: mx.array, idx: mx.array, parts: list[lora_cuda.Part]) -> list[mx.array]:
        if idx.size not in held:
            held[idx.size] = mx.array(idx.tolist(), dtype=mx.uint32)
            mx.eval(held[idx.size])
        return route(x, held[idx.size], parts)

    return call


def step(route: Route, blocks: list[dict[str, list[lora_cuda.Part]]], xs: dict[str, mx.array],
         idx: mx.array) -> list[mx.array]:  # fmt: skip
    return [y for b in blocks for name, parts in b.items() for y in route(xs[name], idx, parts)]


def timed(
    route: Route, blocks: list[dict[str, list[lora_cuda.Part]]], rows: int, steps: int
) -> tuple[float, float]:
    """(ms per pipelined step, host ms per step: building it and `async_eval`)."""
    xs = {name: rand(rows, 1, k) for name, (k, _) in GROUPS.items()}
    idx = kernel_array([1 + i % (SLOTS - 1) for i in range(rows)], mx.uint32)
    return pipelined(lambda: step(route, blocks, xs, idx), steps)


def pipelined(build: Callable[[], list[mx.array]], steps: int) -> tuple[float, float]:
    """(ms per step, host ms per step) of `steps` steps built by `build`, each evaluated
    while the next is built, as decoding does; the host's share is building a step and
    `async_eval`. Three unmeasured steps first."""
    for _ in range(3):
        mx.eval(build())
    host = 0.0
    t0 = time.perf_counter()
    previous: list[mx.array] = []
    for _ in range(steps):
        h0 = time.perf_counter()
        outs = build()
        mx.async_eval(outs)
        host += time.perf_counter() - h0
        if previous:
            mx.eval(previous)
        previous = outs
    mx.eval(previous)
    return (time.perf_counter() - t0) / steps * 1e3, host / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--shapes", default="", help="project kernel shapes CxU to time too")
    args = ap.parse_args()
    if not cuda_available():
        raise SystemExit("the kernels run on MLX's CUDA build")
    mx.random.seed(0)
    blocks = [block() for _ in range(args.blocks)]
    mx.eval(blocks)
    routes: dict[str, Route] = {
        "base": base, "gather": gather, "bare": kernels(term=False),
        "project": kernels(matmul_rows=99),
        "project, idx pooled": pooled(kernels(matmul_rows=99)),
        "matmul+down+up": kernels(matmul_rows=1, fused=False),
        "matmul+term": kernels(matmul_rows=1, fused=True),
    }  # fmt: skip
    widths: dict[str, int] = {}  # a shape's columns a warp: its kernel takes C x rows <= 32
    for text in filter(None, args.shapes.split(",")):
        cols, unroll = (int(v) for v in text.split("x"))
        routes[f"project {text}"] = kernels(matmul_rows=99, shape=(cols, unroll))
        widths[f"project {text}"] = cols
    print(f"{args.blocks} blocks, 7B-shaped bf16, rank {RANK}; ms per pipelined step (host ms)")
    print(f"{'rows':>5} | " + " ".join(f"{n:>23}" for n in routes))
    for rows in (int(r) for r in args.rows.split(",")):
        kernel_rows = 1 if rows == 1 else lora_cuda.MAX_ROWS
        ms = {
            name: timed(route, blocks, rows, args.steps)
            if widths.get(name, 1) * kernel_rows <= 32 else None
            for name, route in routes.items()
        }  # fmt: skip
        base_ms = ms["base"][0] if ms["base"] else 1.0
        cells = [
            "-" if m is None else f"{m[0]:>6.2f} ({m[1]:5.2f}; {m[0] / base_ms:.2f}x)"
            for m in ms.values()
        ]
        print(f"{rows:>5} | " + " ".join(f"{c:>23}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
