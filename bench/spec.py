"""Speculative decoding, side by side in one run: plain decoding, mlxd's draft sources, and
mlx-lm's `speculative_generate_step` at k = 2..6, on the code-pair's held-out code prompts.

    python bench/spec.py --pair ../shared/models/code-pair [--prompts 20] [--tokens 128]

Every method decodes exactly --tokens new tokens per prompt (EOS does not stop it), so the
rates compare like with like. Times include the prompt prefill. Prints one table per
temperature and the ratios the goals are stated in; --json writes the raw numbers.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from mlxd.engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import load_model, measure_costs, warm_up
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs, DraftLengthController, SpecHistory


@dataclass
class Row:
    method: str
    temperature: float
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    from_draft: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def mlxd_run(
    target: nn.Module, draft: nn.Module, prompt: list[int], opts: SamplingOptions,
    method: str, tokens: int, costs: Costs, max_k: int, seed: int, history: SpecHistory,
) -> tuple[int, int, int]:  # fmt: skip
    rng = Rng(seed)
    source: DraftSource | None = None
    controller = None
    draft_cost = costs.draft_step
    if method == "model":
        source = ModelDraftSource(draft, opts, rng)
    elif method == "lookup":
        source, draft_cost = LookupDraftSource(), 0.0
    elif method == "auto":
        source = HybridDraftSource(LookupDraftSource(), ModelDraftSource(draft, opts, rng))
    if source is not None:
        controller = DraftLengthController(
            costs, max_k, draft_cost, history=history, source=source.name, regime=opts.regime
        )
    gen = Generation(target, prompt, opts, set(), tokens, rng, source, controller)
    try:
        gen.prefill()
        n = sum(len(new) for new in gen)
        return n, gen.stats.drafted, gen.stats.accepted
    finally:
        gen.close()


def mlxlm_run(
    target: nn.Module, draft: nn.Module | None, prompt: list[int], temp: float, k: int, tokens: int
) -> tuple[int, int]:
    sampler = make_sampler(temp=temp)
    x = mx.array(prompt)
    n = from_draft = 0
    if draft is None:
        for _ in generate_step(x, target, max_tokens=tokens, sampler=sampler):
            n += 1
        return n, 0
    for _, _, is_draft in speculative_generate_step(
        x, target, draft, num_draft_tokens=k, max_tokens=tokens, sampler=sampler
    ):
        n += 1
        from_draft += int(is_draft)
    return n, from_draft


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pair", type=Path, default=Path(__file__).resolve().parents[2] / "shared/models/code-pair"
    )
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--ks", default="2,3,4,5,6")
    ap.add_argument(
        "--max-k", type=int, default=6, help="mlxd's draft_num_predict (the adaptive maximum)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    # Both engines decode the models as mlxd loads them (float32 on the CPU).
    target, tokenizer, _ = load_model(args.pair / "target", BACKEND)
    draft = load_model(args.pair / "draft", BACKEND)[0]
    heads = json.loads((args.pair / "heldout_prompts.json").read_text())["code"][: args.prompts]
    prompts = [list(tokenizer.encode(h["prompt"])) for h in heads]
    costs = measure_costs(target, draft)
    print(f"device: {mx.default_device()}  prompts: {len(prompts)}  new tokens: {args.tokens}")
    print("measured verify cost v(L) = t(L)/t(1): " + " ".join(
        f"{w}:{costs.v(w) / costs.v(1):.2f}" for w in sorted(costs.verify)
    ) + f"  draft step / target step: {costs.draft_step / costs.v(1):.3f}"
      + f"  plain decoding: {costs.plain * 1e3:.2f} ms/token")  # fmt: skip

    # Warm up mlxd's paths once (kernel compiles, allocator), as its probe-open does.
    warm_up(target, draft, costs, args.max_k)

    ks = [int(k) for k in args.ks.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    ours = ["plain (mlxd)", "mlxd model", "mlxd lookup", "mlxd auto"]
    theirs = ["mlx-lm plain", *(f"mlx-lm k={k}" for k in ks)]
    table = {(t, name): Row(name, t, 0, 0.0) for t in temps for name in ours + theirs}
    history = SpecHistory()  # one pairing's history, as the server keeps it across requests

    def run(name: str, prompt: list[int], seed: int, temp: float) -> tuple[int, ...]:
        if name.startswith("mlx-lm"):
            k = int(name.split("=")[1]) if "=" in name else 0
            return mlxlm_run(target, draft if k else None, prompt, temp, k, args.tokens)
        method = {"plain (mlxd)": "off", "mlxd model": "model", "mlxd lookup": "lookup",
                  "mlxd auto": "auto"}[name]  # fmt: skip
        opts = parse_options({"temperature": temp, "top_k": 0, "top_p": 1.0})
        return mlxd_run(
            target, draft, prompt, opts, method, args.tokens, costs, args.max_k, seed, history
        )

    # Within each engine, methods take turns on each prompt, so a slow spell of the machine hits
    # them alike. The engines run one after the other: mlx-lm's verify forwards land on a new
    # cache length every round, hundreds of new CUDA graphs per prompt, which crowd MLX's graph
    # and buffer caches under whatever runs next.
    for group in (ours, theirs):
        for temp in temps:
            if group is theirs:
                for k in [0, *ks]:
                    mlxlm_run(target, draft if k else None, prompts[0][:16], temp, k, 2 * k + 2)
            for i, prompt in enumerate(prompts):
                for name in group:
                    row = table[temp, name]
                    mx.random.seed(i)
                    t0 = time.perf_counter()
                    out = run(name, prompt, i, temp)
                    row.seconds += time.perf_counter() - t0
                    row.tokens += out[0]
                    if name.startswith("mlxd"):
                        row.drafted += out[1]
                        row.accepted += out[2]
                    elif len(out) > 1:
                        row.from_draft += out[1]
            done = ", ".join(f"{name} {table[temp, name].rate:.1f}" for name in group)
            print(f"temperature {temp}: {done} tok/s", flush=True)  # survives a cut-short run
    rows = list(table.values())
    for temp in temps:
        report([r for r in rows if r.temperature == temp], temp)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"rate": r.rate} for r in rows], indent=1))


def report(rows: list[Row], temp: float) -> None:
    plain = next(r for r in rows if r.method == "plain (mlxd)").rate
    print(f"\ntemperature {temp}")
    print(f"{'method':<16}{'tok/s':>9}{'vs plain':>10}{'acceptance':>12}{'from draft':>12}")
    for r in rows:
        acc = f"{r.acceptance:.3f}" if r.drafted else "-"
        share = f"{r.from_draft / r.tokens:.3f}" if r.from_draft else (
            f"{r.accepted / r.tokens:.3f}" if r.drafted else "-"
        )  # fmt: skip
        print(f"{r.method:<16}{r.rate:>9.1f}{r.rate / plain:>9.2f}x{acc:>12}{share:>12}")
    ours = max((r for r in rows if r.method.startswith("mlxd")), key=lambda r: r.rate)
    theirs = max((r for r in rows if r.method.startswith("mlx-lm k=")), key=lambda r: r.rate)
    floor = min(r.rate for r in rows if r.method.startswith("mlxd")) / plain
    print(
        f"best mlxd ({ours.method}) / best mlx-lm ({theirs.method}): {ours.rate / theirs.rate:.2f}x"
        f"   slowest mlxd method / plain: {floor:.2f}x"
        f"   mlx-lm plain / mlxd plain: {next(r for r in rows if r.method == 'mlx-lm plain').rate / plain:.2f}x"
    )


if __name__ == "__main__":
    main()
