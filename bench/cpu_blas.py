"""What the CPU BLAS buys on Linux, per megabyte installed: MKL under MLX vs MLX's own
(reference) BLAS, side by side in one run.

    python bench/cpu_blas.py [--model DIR] [--blas /path/to/libopenblas.so]

Each BLAS runs in its own process (a BLAS goes under MLX before MLX is imported, once per
process), configured as `mlxd serve` configures it (`configure_backend`: with a fast BLAS a
16-bit model computes in float32). Measured: float32 matmul GFLOP/s at decoding and prefill
shapes, and the model's plain greedy decoding (tokens/s, one row) and prefill (tokens/s of a
512-token prompt). Then the megabytes each choice installs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = Path("/work/shared/models/code-pair/target")
MKL_DISTS = ("mkl", "intel-openmp", "tbb", "tcmlib", "umf", "intel-cmplr-lib-ur")


def installed_mb(dists: tuple[str, ...]) -> float:
    total = 0
    for name in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            total += sum(f.size or 0 for f in importlib.metadata.distribution(name).files or [])
    return total / 1e6


def child(model_dir: Path) -> dict[str, float | str | None]:
    from mlxd.engine.backend import configure_backend

    backend = configure_backend()  # reads MLXD_CPU_BLAS, loads the BLAS before MLX
    import mlx.core as mx

    from mlxd.engine.generation import Generation
    from mlxd.engine.kvcache import make_cache
    from mlxd.engine.options import parse_options
    from mlxd.engine.pairing import load_model
    from mlxd.engine.prefill import feed
    from mlxd.engine.sampling import Rng

    def timed(fn: object, reps: int = 7) -> float:
        samples = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            mx.eval(fn())  # type: ignore[operator]
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples[1:])

    out: dict[str, float | str | None] = {"blas": backend.cpu_blas, "f32": backend.float32_compute}
    for rows in (1, 8, 512):
        a = mx.random.normal((rows, 2048))
        b = mx.random.normal((2048, 2048))
        mx.eval(a, b)
        out[f"gemm{rows}"] = 2 * rows * 2048 * 2048 / timed(lambda a=a, b=b: a @ b) / 1e9

    model, _, _ = load_model(model_dir, backend)
    prompt = [(i * 7919) % 4000 + 10 for i in range(512)]

    def prefill() -> object:
        cache = make_cache(model)
        feed(model, cache, prompt)
        return [c.state for c in cache]

    out["prefill_tps"] = len(prompt) / timed(prefill, 3)
    opts = parse_options({"temperature": 0})
    gen = Generation(model, prompt[:64], opts, set(), 65, Rng(0))
    gen.prefill()
    stamps = [time.perf_counter() for _ in gen]
    gen.close()
    out["decode_tps"] = (len(stamps) - 5) / (stamps[-1] - stamps[4])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--blas", default=None, help="also a library exporting cblas_sgemm")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    choices = {"MKL (auto)": "auto", "MLX's own (off)": "off"}
    if args.blas:
        choices[f"{args.blas}"] = args.blas
    results = {}
    for label, value in choices.items():
        env = {**os.environ, "MLXD_CPU_BLAS": value}
        run = subprocess.run(
            [sys.executable, __file__, "--child", "--model", str(args.model)],
            env=env, capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        results[label] = json.loads(run.stdout.strip().splitlines()[-1])
    keys = ("gemm1", "gemm8", "gemm512", "prefill_tps", "decode_tps")
    print(f"model {args.model}; MKL and its runtime install {installed_mb(MKL_DISTS):.0f} MB")
    print(f"{'':<20}" + "".join(f"{k:>13}" for k in keys) + "   float32 compute")
    for label, r in results.items():
        print(f"{label:<20}" + "".join(f"{r[k]:>13.1f}" for k in keys) + f"   {r['f32']}")
    base = results["MLX's own (off)"]
    for label, r in results.items():
        if label != "MLX's own (off)":
            ratios = "".join(f"{r[k] / base[k]:>12.1f}x" for k in keys)
            print(f"{label + ' / off':<20}{ratios}")
    print("(gemm: GFLOP/s of float32 (rows x 2048) @ (2048 x 2048); prefill, decode: tokens/s)")


if __name__ == "__main__":
    main()
