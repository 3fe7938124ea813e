"""4-bit projections of a few tokens by route, and a 4-bit model's verify forwards with each.

    python bench/qmatmul.py [--blocks 28] [--tokens 1,2,4,8,16,32] [--model PATH]

On MLX's CUDA build, for 7B-shaped blocks quantized to 4 bits (groups of 64, bf16 scales),
times pipelined steps of `--blocks` blocks' projections (q, k, v; o; gate, up; down) of one
row of L tokens, by route:

- `mlx`: MLX's quantized matmul per projection;
- `qmma`: `qmma_cuda`'s kernel, one launch per input (and built with other warp counts and W
  tiles per warp: `--shapes`).

Prints milliseconds per step, the host's share, each route's ratio to `mlx`, and the largest
difference of `qmma`'s outputs from `mlx`'s (relative to the largest output). With `--model`
(a 4-bit model), also times that model's synchronous forwards of L tokens over a cache (a
verify round) with MLX's projections and then with `fewrows` installed, their ratio to one
token, and how far the two routes' logits differ.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load

from bench.decode_matmul import GROUPS
from bench.lora_kernels import pipelined
from mlxd.engine import fewrows, qmma_cuda
from mlxd.engine.attention import cuda_available
from mlxd.engine.kvcache import GPU_BUCKET, make_cache, set_bucket

GROUP_SIZE = 64
Parts = list[qmma_cuda.Quantized]
Block = dict[str, Parts]
Route = Callable[[mx.array, Parts], list[mx.array]]


def quantized(n: int, k: int) -> qmma_cuda.Quantized:
    w, s, o = mx.quantize(0.02 * mx.random.normal((n, k)), group_size=GROUP_SIZE, bits=4)
    return w, s.astype(mx.bfloat16), o.astype(mx.bfloat16)


def mlx_route(x: mx.array, parts: Parts) -> list[mx.array]:
    return [
        mx.quantized_matmul(x, w, s, o, transpose=True, group_size=GROUP_SIZE, bits=4)
        for w, s, o in parts
    ]


def qmma_route(x: mx.array, parts: Parts) -> list[mx.array]:
    return qmma_cuda.matmul(x, parts, None, GROUP_SIZE)


def qmma_shaped(warps: int, wt: int) -> Route:
    """`qmma_cuda`'s kernel built with `warps` warps per block and `wt` W tiles per warp."""
    compiled = mx.compile(
        lambda x, *flat: qmma_cuda.flat_matmul(
            x, *flat, bias=False, group_size=GROUP_SIZE, warps=warps, wt=wt
        )
    )

    def route(x: mx.array, parts: Parts) -> list[mx.array]:
        return list(compiled(x, *(a for p in parts for a in p)))

    return route


def step(route: Route, blocks: list[Block], xs: dict[str, mx.array]) -> list[mx.array]:
    return [y for b in blocks for name, parts in b.items() for y in route(xs[name], parts)]


def rand_x(tokens: int) -> dict[str, mx.array]:
    return {
        name: mx.random.normal((1, tokens, k)).astype(mx.bfloat16)
        for name, (k, _) in GROUPS.items()
    }


def largest_difference(blocks: list[Block], tokens: int) -> float:
    xs = rand_x(tokens)
    worst = 0.0
    for name, parts in blocks[0].items():
        for a, b in zip(qmma_route(xs[name], parts), mlx_route(xs[name], parts), strict=True):
            b32 = b.astype(mx.float32)
            scale = mx.abs(b32).max().item()
            worst = max(worst, mx.abs(a.astype(mx.float32) - b32).max().item() / scale)
    return worst


def projections(args: argparse.Namespace) -> None:
    mx.random.seed(0)
    blocks = []
    for _ in range(args.blocks):
        block = {name: [quantized(n, k) for n in outs] for name, (k, outs) in GROUPS.items()}
        mx.eval(block)
        blocks.append(block)
    routes: dict[str, Route] = {"mlx": mlx_route, "qmma": qmma_route}
    for shape in filter(None, args.shapes.split(",")):
        warps, wt = (int(v) for v in shape.split("x"))
        routes[f"qmma {shape}"] = qmma_shaped(warps, wt)
    print(f"{args.blocks} blocks, 7B-shaped, 4-bit (groups of {GROUP_SIZE}); ms per pipelined"
          " step of one row's L tokens (host ms; vs mlx)")  # fmt: skip
    print(f"{'L':>4} | " + " ".join(f"{n:>24}" for n in routes) + " | qmma error")
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = rand_x(tokens)
        ms = {name: pipelined(lambda r=r, xs=xs: step(r, blocks, xs), args.steps)
              for name, r in routes.items()}  # fmt: skip
        base = ms["mlx"][0]
        cells = [f"{t:6.2f} ({h:5.2f}; {t / base:4.2f}x)" for t, h in ms.values()]
        error = largest_difference(blocks, tokens)
        print(f"{tokens:>4} | " + " ".join(f"{c:>24}" for c in cells) + f" | {error:.1e}",
              flush=True)  # fmt: skip


def forward_ms(model: nn.Module, widths: list[int], context: int, reps: int) -> list[float]:
    """Median ms of one synchronous forward of each width over a `context`-token cache, each
    forward at a fresh cache length (as verify rounds land)."""
    cache = make_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.uint32), cache=cache))
    out = []
    for width in [1, *widths]:
        samples = []
        for _ in range(reps):
            x = mx.zeros((1, width), dtype=mx.uint32)
            t0 = time.perf_counter()
            mx.eval(model(x, cache=cache))
            samples.append(time.perf_counter() - t0)
        out.append(statistics.median(samples) * 1e3)
    return out[1:]  # the first width's run warmed the shapes up


def whole_model(path: Path, tokens: list[int], reps: int) -> None:
    model = load(str(path))[0]
    set_bucket(model, GPU_BUCKET)
    prompt = mx.array([[(7 * i + 3) % 1000 for i in range(64)]])
    probe = mx.array([[(5 * i + 1) % 1000 for i in range(8)]])

    def logits() -> mx.array:
        cache = make_cache(model)
        model(prompt, cache=cache)
        return model(probe, cache=cache).astype(mx.float32)

    before = logits()
    mlx_ms = forward_ms(model, tokens, 200, reps)
    grouped = fewrows.install(model)
    after = logits()
    qmma_ms = forward_ms(model, tokens, 200, reps)
    groups = {id(m.group): m.group for _, m in model.named_modules() if hasattr(m, "group")}
    for group in groups.values():  # one token too: a decode step on the kernel
        group.min_tokens = 1
    every_ms = forward_ms(model, tokens, 200, reps)
    diff = mx.abs(after - before).max().item() / mx.abs(before).max().item()
    same = mx.mean(mx.argmax(after, -1) == mx.argmax(before, -1)).item()
    print(f"\n{path}: {grouped} projections grouped; ms per forward of L tokens (v(L)),"
          " and the kernel's ratio to MLX's")  # fmt: skip
    print(f"{'L':>4} | {'mlx':>14} | {'fewrows':>14} | ratio | {'1 token too':>14} | ratio")
    for w, a, b, c in zip(tokens, mlx_ms, qmma_ms, every_ms, strict=True):
        print(f"{w:>4} | {a:7.2f} ({a / mlx_ms[0]:4.2f}) | {b:7.2f} ({b / qmma_ms[0]:4.2f}) |"
              f" {b / a:.2f}x | {c:7.2f} ({c / every_ms[0]:4.2f}) | {c / a:.2f}x")  # fmt: skip
    print(f"logits: largest difference {diff:.1e} of the largest; argmax agrees on {same:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=28)
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--shapes", default="8x1,8x4,4x2",
                    help="more builds of the kernel: WARPSxWTILES,...")  # fmt: skip
    ap.add_argument("--model", type=Path, default=None, help="a 4-bit model's folder")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if not cuda_available():
        raise SystemExit("the kernels run on MLX's CUDA build")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.blocks:
        projections(args)
    if args.model is not None:
        whole_model(args.model, tokens, args.reps)


if __name__ == "__main__":
    main()
