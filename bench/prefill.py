"""Prefill, side by side in one run: mlxd's time to first token over HTTP next to mlx-lm's
`generate_step` in-process, same model, same prompts' sizes.

    python bench/prefill.py [--model DIR | --shape 8b] [--sizes 512,2048,7000] [--repeats 3]
                            [--paths exact,masked]

One run:
1. Serves the model (entry `bench`) from an in-process daemon (the real app under uvicorn, as
   `mlxd serve` runs it) with a fresh prefix-cache directory, as users get it.
2. One 64-token warm-up request, then per size: the *first* request of that size after start,
   `--repeats` cold requests (each prompt new to the cache), and the last prompt once more
   (warm from RAM). TTFT is the time from sending the request to the first NDJSON line.
3. mlx-lm, on the same loaded arrays (loaded as mlxd loads them): one untimed run per size, then
   `--repeats` fresh prompts timed to the first token `generate_step` yields.

It prints, per size, medians in ms and the ratios the goals are stated in: mlxd cold over mlx-lm
cold (goal <= 1.1), the first request over later cold ones (goal <= 1.2) and RAM-warm over cold,
and the server's own `prompt_eval_duration` of the cold, first and warm requests (what is left of
TTFT is HTTP, tokenizing and queueing: the server counts the prompt until its first token is
read, the first decode step included, as Ollama does).
Without `--model` or `--shape`, a random-weight Llama of the code-pair target's shape with a
16k context is built (the code pair's own context is too short for 7k-token prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlxd.engine.backend import configure_backend  # noqa: E402

BACKEND = configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX

from bench.cache import Daemon, Prompts, build_long_model, generate  # noqa: E402
from mlxd.engine import kvcache  # noqa: E402

EXACT_MIN = kvcache.EXACT_MIN
PATHS = {"exact": "exact keys (causal)", "masked": "the padded buffer, masked"}
from bench.concurrency import SHAPES, random_model  # noqa: E402

CODE_PAIR = ROOT.parent / "shared" / "models" / "code-pair" / "target"
GREEDY = {"temperature": 0, "num_predict": 1, "draft_method": "off"}


@dataclass
class SizeResult:
    size: int
    first: float = 0.0
    cold: list[float] = field(default_factory=list)
    server: list[float] = field(default_factory=list)  # the server's prompt_eval_duration
    warm: float = 0.0
    server_first: float = 0.0
    server_warm: float = 0.0
    mlx_lm: list[float] = field(default_factory=list)

    def row(self) -> str:
        cold, ref = statistics.median(self.cold), statistics.median(self.mlx_lm)
        return (
            f"{self.size:>7} {self.first * 1e3:9.0f} {cold * 1e3:9.0f} {ref * 1e3:9.0f} "
            f"{cold / ref:8.2f}x {self.first / cold:8.2f}x {self.warm * 1e3:9.0f} "
            f"{self.warm / cold:8.2f}x {self.size / cold:9.0f} "
            f"{statistics.median(self.server) * 1e3:9.0f} {self.server_first * 1e3:9.0f} "
            f"{self.server_warm * 1e3:9.0f}"
        )


def mlxd_side(
    model_dir: Path, sizes: list[int], repeats: int, prompts: Prompts, settle: float = 0.0
) -> list[SizeResult]:
    results = [SizeResult(size) for size in sizes]
    with tempfile.TemporaryDirectory(prefix="mlxd-prefill-") as tmp:
        registry = Path(tmp) / "models.yaml"
        entry = {"target": str(model_dir), "options": {"num_ctx": max(sizes) + 64}}
        registry.write_text(json.dumps({"version": 1, "models": {"bench": entry}}))
        with Daemon(registry, Path(tmp) / "kvcache", 8 * 2**30, 16 * 2**30) as daemon:
            generate(daemon, "bench", prompts.exact(64, "warm-up"), GREEDY)
            for result in results:
                first = generate(
                    daemon, "bench", prompts.exact(result.size, f"first-{result.size}"), GREEDY
                )
                result.first, result.server_first = first.ttft, first.prefill
                text = ""
                for i in range(repeats):
                    text = prompts.exact(result.size, f"cold-{i}-{result.size}")
                    timed = generate(daemon, "bench", text, GREEDY)
                    result.cold.append(timed.ttft)
                    result.server.append(timed.prefill)
                time.sleep(settle)  # the last request's cache work may still be running
                warm = generate(daemon, "bench", text, GREEDY)
                result.warm, result.server_warm = warm.ttft, warm.prefill
    return results


def mlx_lm_side(model_dir: Path, results: list[SizeResult], repeats: int, prompts: Prompts) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlxd.engine.pairing import load_model

    model, _, _ = load_model(model_dir, BACKEND)
    for result in results:
        for i in range(repeats + 1):  # the first run of each size is untimed, as a warm-up
            tokens = mx.array(
                prompts.encode(prompts.exact(result.size, f"mlx-lm-{i}-{result.size}"))
            )
            start = time.perf_counter()
            token, _ = next(generate_step(tokens, model, max_tokens=1))
            _ = int(token)
            if i:
                result.mlx_lm.append(time.perf_counter() - start)
    del model


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory (default: built, see above)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight Llama of this shape")
    ap.add_argument("--sizes", default="512,2048,7000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="layers of the default built model")
    ap.add_argument("--work", type=Path, help="where built models go (default: a temp dir)")
    ap.add_argument("--tokenizer", type=Path, default=CODE_PAIR, help="the code pair's target")
    ap.add_argument("--settle", type=float, default=0.0, help="seconds before the warm request")
    ap.add_argument(
        "--paths", default="exact", help="exact,masked: how wide prompt chunks attend (GPU)"
    )
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="mlxd-prefill-models-"))
    if args.model is not None:
        model_dir = args.model.resolve()
    elif args.shape is not None:
        model_dir = random_model(work / args.shape, args.tokenizer, SHAPES[args.shape])
    else:
        model_dir = build_long_model(work / "long", args.tokenizer, args.layers)
    prompts = Prompts(args.tokenizer, seed=0)
    print(f"model {model_dir}, sizes {sizes}, {args.repeats} cold repeats", flush=True)
    runs: dict[str, list[SizeResult]] = {}
    for path in args.paths.split(","):  # how wide prompt chunks attend (GPU layout only)
        kvcache.EXACT_MIN = EXACT_MIN if path == "exact" else 0
        runs[path] = mlxd_side(model_dir, sizes, args.repeats, prompts, args.settle)
    reference = next(iter(runs.values()))
    mlx_lm_side(model_dir, reference, args.repeats, prompts)
    for path, results in runs.items():
        print(f"-- wide chunks attend over {PATHS[path]}")
        print(
            f"{'tokens':>7} {'1st ms':>9} {'cold ms':>9} {'mlx-lm':>9} {'vs mlx-lm':>9} "
            f"{'1st/cold':>9} {'warm ms':>9} {'warm/cold':>9} {'tok/s':>9} {'srv pf ms':>9} "
            f"{'srv 1st':>9} {'srv warm':>9}"
        )
        for result, ref in zip(results, reference, strict=True):
            result.mlx_lm = ref.mlx_lm
            print(result.row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
