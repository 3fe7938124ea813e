"""Decoding in-process, without the server: mlxd's rows next to mlx-lm, same model, same run.

    python bench/rows.py [--model DIR | --shape 8b] [--rows 1,2,4,8] [--tokens 128]

Separates the engine from the server. For each row count B, B prompts of different lengths are
read (not timed), then every row decodes `--tokens` tokens with EOS ignored: mlxd's lone row
(`Generation.step`, B = 1) or its batch (`RowBatch.round`; `1b`: one row as a batch of one),
against mlx-lm's `generate_step` (B = 1) and `BatchGenerator` (every other B), greedy and at
temperature 0.7. Prints aggregate tokens/s, milliseconds per round and mlxd / mlx-lm. `--shape`
builds a random-weight Llama in memory (bf16), as `bench/batch_step.py` does. The last columns run mlxd's rows again on a thread of
their own, as `mlxd serve` decodes (one runner thread per pairing, with that thread's streams):
a served stream that decodes slower than the in-process one shows here first if the thread is
the cause. With `MLXD_FUSE_MLP=1` on a GPU, mlxd's rows run on fused MLPs (`engine.fusedproj`)
and mlx-lm's on a second copy of the model as it loads.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()  # first, as `mlxd serve` does

# isort: split
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_sampler

from bench.concurrency import SHAPES
from mlxd.engine import rowpad
from mlxd.engine.batch import RowBatch
from mlxd.engine.fusedproj import fuse_gate_up
from mlxd.engine.generation import Generation
from mlxd.engine.kvcache import set_bucket
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import measure_costs
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs
from mlxd.engine.threads import start_mlx_thread

ROOT = Path(__file__).resolve().parent.parent


def build(args: argparse.Namespace) -> Any:
    if args.shape is None:
        return load(str(args.model))[0]
    config = {"model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, **SHAPES[args.shape]}  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def as_served(model: Any) -> dict[int, int]:
    """Lay `model` out as `mlxd serve` would: bucketed caches, projections padded where the
    measured forward costs say (`engine.rowpad`). Returns the padding."""
    set_bucket(model, BACKEND.kv_bucket)
    costs = measure_costs(model, None)
    curve = " ".join(f"{w}:{s / costs.v(1):.2f}" for w, s in sorted(costs.verify.items()))
    print(f"v(L) as padded: {curve}")
    return costs.padded


def prompts_for(rows: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(40 + 9 * i)] for i in range(rows)]


def mlxd_rate(
    model: Any, prompts: list[list[int]], tokens: int, temp: float, batch_of_one: bool = False
) -> float:
    opts = parse_options({"temperature": temp, "top_k": 0, "top_p": 1.0, "seed": 1})
    gens = [Generation(model, p, opts, set(), tokens, Rng(i)) for i, p in enumerate(prompts)]
    for g in gens:
        g.prefill()
    if len(gens) == 1 and not batch_of_one:
        g = gens[0]
        g.step()  # the first token (and the first queued forward) comes before the clock
        t0, made = time.perf_counter(), 1
        while not g.done:
            made += len(g.step())
        mx.synchronize()
        return (made - 1) / (time.perf_counter() - t0)
    batch = RowBatch(model, Costs(verify={1: 1.0}))
    batch.join(gens)
    batch.round()
    t0, made = time.perf_counter(), 0
    while all(g.produced < tokens for g in gens):
        made += sum(len(c.tokens) for c in batch.round())
    batch.drop_ahead()
    mx.synchronize()
    return made / (time.perf_counter() - t0)


def mlxlm_rate(model: Any, prompts: list[list[int]], tokens: int, temp: float) -> float:
    sampler = make_sampler(temp=temp)
    if len(prompts) == 1:
        steps = generate_step(mx.array(prompts[0]), model, max_tokens=tokens, sampler=sampler)
        next(steps)
        t0, made = time.perf_counter(), 0
        for _ in steps:
            made += 1
        return made / (time.perf_counter() - t0)
    gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], sampler=sampler)
    try:
        gen.insert(prompts, max_tokens=[tokens] * len(prompts))
        started: set[int] = set()
        while len(started) < len(prompts):  # every prompt read, every row's first token out
            started.update(r.uid for r in gen.next_generated())
        t0, made, finished = time.perf_counter(), 0, 0
        while finished < len(prompts):
            out = gen.next_generated()
            if not out:
                break
            made += len(out)
            finished += sum(1 for r in out if r.finish_reason is not None)
        return made / (time.perf_counter() - t0)
    finally:
        gen.close()


def threaded(
    model: Any, prompts: list[list[int]], tokens: int, temp: float, batch_of_one: bool
) -> float:
    """mlxd's rows on a thread of their own, as a pairing's runner decodes. The thread first
    decodes a few untimed tokens: MLX's CUDA build keeps compiled kernels per thread, and a
    runner warms its shapes on its own thread too."""
    box: list[float] = []

    def run() -> None:
        mlxd_rate(model, prompts, 8, temp, batch_of_one)
        box.append(mlxd_rate(model, prompts, tokens, temp, batch_of_one))

    start_mlx_thread(run, "bench-rows").join()
    if not box:
        raise RuntimeError("the decoding thread failed (its traceback is above)")
    return box[0]


@contextmanager
def unpadded(model: Any, padded: dict[int, int]) -> Iterator[None]:
    """mlx-lm runs the model as it loads it."""
    rowpad.install(model, {})
    try:
        yield
    finally:
        rowpad.install(model, padded)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=ROOT.parent / "shared/models/code-pair/target")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument(
        "--rows", default="1,2,4,8", help="row counts; 1b: one row decoding as a batch of one"
    )
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="0,0.7")
    args = ap.parse_args()
    model = build(args)
    plain = model  # what mlx-lm runs: the model as it loads it
    if BACKEND.fused_mlp:  # MLXD_FUSE_MLP=1: mlxd's rows on fused MLPs, mlx-lm's on a copy
        plain = build(args)
        fuse_gate_up(model)
    padded = as_served(model)
    theirs_padded = padded if plain is model else {}  # a copy stays as loaded
    vocab = model.args.vocab_size
    counts = args.rows.split(",")
    temps = [float(t) for t in args.temps.split(",")]
    mlxd_rate(model, prompts_for(2, vocab), 8, 0.0)  # warm both sides' shapes
    with unpadded(plain, theirs_padded):
        mlxlm_rate(plain, prompts_for(2, vocab), 8, 0.0)
    print(f"device {mx.default_device()}  tokens per row {args.tokens}  padded {padded}")
    print(f"{'temp':>5} {'rows':>5} | {'mlxd tok/s':>10} {'ms/round':>9} | "
          f"{'mlx-lm tok/s':>12} {'ms/round':>9} | {'mlxd/mlx-lm':>11} | "
          f"{'on a thread':>11} {'thread/main':>11}")  # fmt: skip
    for temp in temps:
        for count in counts:
            b, one = int(count.rstrip("b")), count.endswith("b")
            prompts = prompts_for(b, vocab)
            ours = mlxd_rate(model, prompts, args.tokens, temp, one)
            with unpadded(plain, theirs_padded):
                theirs = mlxlm_rate(plain, prompts, args.tokens, temp)
            served = threaded(model, prompts, args.tokens, temp, one)
            print(
                f"{temp:>5} {count:>5} | {ours:>10.1f} {1e3 * b / ours:>9.2f} | "
                f"{theirs:>12.1f} {1e3 * b / theirs:>9.2f} | {ours / theirs:>10.2f}x | "
                f"{served:>11.1f} {served / ours:>10.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
