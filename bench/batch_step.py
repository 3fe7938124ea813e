"""Cost of one batched decode step by batch size: where padding a batch with idle rows pays.

    python bench/batch_step.py [--shape 8b] [--rows 1,2,...,16]

Builds a random-weight Llama of the given shape in memory (bf16) and times one single-token
forward for B rows of different lengths over a bucketed batch cache: with the masked attention
mlx-lm runs, and (on MLX's CUDA build) with mlxd's per-row attention kernel; plus the bare
matmul of its MLP's up projection for the same number of rows. On the CUDA build the matmul
kernel changes with the row count, so a step for a few rows can cost more than for more rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import SHAPES
from mlxd.engine.attention import cuda_available, install_batched_decode
from mlxd.engine.kvcache import BucketedBatchKVCache


def median_ms(fn: object, reps: int = 12) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())  # type: ignore[operator]
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--rows", default=",".join(str(b) for b in range(1, 17)))
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    config = {"model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, **shape}  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    w = model.layers[0].mlp.up_proj.weight
    print(f"device {mx.default_device()}  shape {args.shape}  context {args.context}")
    rows = [int(r) for r in args.rows.split(",")]
    masked = {b: step_ms(model, b, args.context) for b in rows}
    routed = cuda_available()
    if routed:
        install_batched_decode()  # what the backend configuration does on CUDA
    print(f"{'rows':>5} {'masked ms':>10} {'per-row ms':>11} {'ms/row':>8} {'matmul ms':>10}")
    for b in rows:
        ragged = step_ms(model, b, args.context) if routed else float("nan")
        h = mx.random.normal((b, shape["hidden_size"])).astype(mx.bfloat16)
        mm_ms = median_ms(lambda h=h: h @ w.T)
        best = min(masked[b], ragged) if routed else masked[b]
        print(f"{b:>5} {masked[b]:>10.2f} {ragged:>11.2f} {best / b:>8.2f} {mm_ms:>10.3f}")


def step_ms(model: llama.Model, rows: int, context: int) -> float:
    """One decode step for `rows` rows whose prompts differ in length (left padding 0..15)."""
    cache = [BucketedBatchKVCache([(3 * i) % 16 for i in range(rows)]) for _ in model.layers]
    mx.eval(model(mx.zeros((rows, context), dtype=mx.uint32), cache=cache))
    x = mx.zeros((rows, 1), dtype=mx.uint32)

    def step() -> mx.array:
        out = model(x, cache=cache)
        for c in cache:
            c.trim(1)
        return out

    return median_ms(step)


if __name__ == "__main__":
    main()
