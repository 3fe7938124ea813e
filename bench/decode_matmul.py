"""A decode step's base projections by route: what 1-8 rows cost the host and the device.

    python bench/decode_matmul.py [--blocks 28] [--rows 1,2,4,8,16,32] [--steps 60]

On MLX's CUDA build, for 7B-shaped bf16 blocks (q, k, v; o; gate, up; down), times pipelined
steps of `--blocks` blocks' projections of rows x 1 token (each step's outputs evaluated while
the next is built, as decoding does), by route:

- `matmul`: MLX's matmul per projection (a gemv for one row, cuBLAS for more);
- `project`: `lora_cuda`'s project kernel, one launch per input (q, k, v together; gate, up);
- `mma`: `mma_cuda`'s tensor-core kernel, one launch per input (and, uncompiled, built with
  other warp counts, unrolls and W tiles per warp: `--mma-shapes`).

Prints milliseconds per step, the host's share of it (building the step and `async_eval`),
each route's ratio to `matmul`, and the largest difference of `mma`'s outputs from `matmul`'s.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

# isort: split
import mlx.core as mx

from bench.lora_kernels import pipelined
from mlxd.engine import lora_cuda, mma_cuda
from mlxd.engine.attention import cuda_available

HIDDEN, KV, MLP = 3584, 512, 18944
GROUPS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)),
          "mlp": (HIDDEN, (MLP, MLP)), "down": (MLP, (HIDDEN,))}  # fmt: skip
Block = dict[str, list[mx.array]]
Route = Callable[[mx.array, list[mx.array]], list[mx.array]]


def rand(*shape: int) -> mx.array:
    return (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)


def matmul(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    return [x @ w.T for w in weights]


def project(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
    return lora_cuda.project(x, None, [lora_cuda.Part(None, w, None, None) for w in weights])


def mma_shaped(warps: int, unroll: int, wt: int) -> Route:
    """`mma_cuda`'s kernel built with `warps` warps per block, `unroll` pieces in flight and
    `wt` tiles of 16 W rows per warp."""

    def route(x: mx.array, weights: list[mx.array]) -> list[mx.array]:
        tiles = -(-x.shape[0] * x.shape[1] // 8)
        return list(mma_cuda._kernel(len(weights), False, x.dtype)(
            inputs=[x, *weights],
            template=mma_cuda.template(x, warps, (tiles, unroll, wt)),
            grid=(mma_cuda.blocks_for(x, weights, wt) * warps * 32, 1, 1),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[(*x.shape[:-1], w.shape[0]) for w in weights],
            output_dtypes=[x.dtype] * len(weights),
        ))  # fmt: skip

    return route


def step(route: Route, blocks: list[Block], xs: dict[str, mx.array]) -> list[mx.array]:
    return [y for b in blocks for name, ws in b.items() for y in route(xs[name], ws)]


def timed(route: Route, blocks: list[Block], rows: int, steps: int) -> tuple[float, float]:
    """(ms per pipelined step, host ms per step)."""
    xs = {name: rand(rows, 1, k) for name, (k, _) in GROUPS.items()}
    return pipelined(lambda: step(route, blocks, xs), steps)


def largest_difference(blocks: list[Block], rows: int) -> float:
    xs = {name: rand(rows, 1, k) for name, (k, _) in GROUPS.items()}
    worst = 0.0
    for name, ws in blocks[0].items():
        for a, b in zip(mma_cuda.matmul(xs[name], ws), matmul(xs[name], ws), strict=True):
            scale = mx.abs(b.astype(mx.float32)).max().item()
            worst = max(worst, mx.abs(a.astype(mx.float32) - b).max().item() / scale)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=28)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mma-shapes", default="8x2x1,8x1x2,8x2x2",
                    help="more builds of the mma kernel: WARPSxUNROLLxWTILES,...")  # fmt: skip
    args = ap.parse_args()
    if not cuda_available():
        raise SystemExit("the kernels run on MLX's CUDA build")
    mx.random.seed(0)
    blocks = [{name: [rand(n, k) for n in outs] for name, (k, outs) in GROUPS.items()}
              for _ in range(args.blocks)]  # fmt: skip
    mx.eval(blocks)
    routes: dict[str, Route] = {"matmul": matmul, "project": project, "mma": mma_cuda.matmul}
    for shape in filter(None, args.mma_shapes.split(",")):
        warps, unroll, wt = (int(v) for v in shape.split("x"))
        routes[f"mma {shape}"] = mma_shaped(warps, unroll, wt)
    print(f"{args.blocks} blocks, 7B-shaped bf16; ms per pipelined step (host ms; vs matmul)")
    print(f"{'rows':>5} | " + " ".join(f"{n:>24}" for n in routes) + " | mma error")
    for rows in (int(r) for r in args.rows.split(",")):
        ms = {name: timed(route, blocks, rows, args.steps) for name, route in routes.items()}
        base = ms["matmul"][0]
        cells = [f"{t:6.2f} ({h:5.2f}; {t / base:4.2f}x)" for t, h in ms.values()]
        error = largest_difference(blocks, rows)
        print(f"{rows:>5} | " + " ".join(f"{c:>24}" for c in cells) + f" | {error:.1e}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
