"""Speculative decoding, side by side in one run: plain decoding, mlxd's draft sources, and
mlx-lm's plain `generate_step` and `speculative_generate_step` at k = 2..6, on the code-pair's
held-out code prompts.

    python bench/spec.py --pair ../shared/models/code-pair [--prompts 20] [--tokens 128]
    python bench/spec.py --pair ../shared/models/code-pair --fat [--pairs code,fat-bf16,fat-4bit]

`--fat` builds the code pair fattened to the cost of a 7B target and a 0.5B draft (hidden 3584,
28 layers, MLP 18944; draft 896 / 24 / 4864; `--fat-target` / `--fat-draft` change the shapes)
with the code pair's `../fatten.py`, in bf16 and 4-bit, into --work (built once, then reused),
and benchmarks the pairs one after the other: the same prompts, the same tokens, one table per
pair and a summary of every pair at the end (plain tok/s, mlx-lm plain and each mlxd method as
a ratio to plain). The fat pairs are slow on a CPU: keep --prompts and --tokens small there.

`mlxd lookup/4` is prompt lookup verifying up to 4 candidates in one round where the measured
costs say they are free (`engine.branches`, `MLXD_BRANCHES=4`), beside `mlxd lookup`, which
verifies its own draft only (the default); `mlxd lookup/read` is prompt lookup with every round
built after the host read the token before it (`MLXD_ROUND_BEHIND=0`), where `mlxd lookup` queues
a round behind a token in flight when it can guess the round's drafts (`Generation._round_behind`).
Those two are comparisons: the slowest-method lines read the methods a request can pick
(`model`, `lookup`, `auto`).

Every method decodes exactly --tokens new tokens per prompt (EOS does not stop it), so the
rates compare like with like. Times include the prompt prefill; each engine reads every
prompt once before anything is timed, so no method pays a prompt's first prefill. Prints one
table per temperature and the ratios the goals are stated in; --json writes the raw numbers.
Each table also counts mlxd's slow steps: those that took over `SLOW` times what the measured
costs say (a draft model catching up on the context at a trial, a shape's first forward on a
GPU), and the share of the method's time spent beyond those costs; then where each method's
time went (prompts, plain steps, speculative rounds) and its slow steps by draft count.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()  # first, as `mlxd serve` does: the CPU BLAS goes under MLX

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.sample_utils import make_sampler

from mlxd.engine import branches, generation
from mlxd.engine.drafting import DraftSource, HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import draft_cap, load_model, measure_costs, warm_up
from mlxd.engine.sampling import Rng
from mlxd.engine.speculation import Costs, DraftLengthController, SpecHistory


@dataclass
class Split:
    """Where an mlxd method's time went: reading prompts, steps that decoded one token plainly,
    and speculative rounds (what they committed)."""

    prefill: float = 0.0
    plain_steps: int = 0
    plain_seconds: float = 0.0
    rounds: int = 0
    round_seconds: float = 0.0
    round_tokens: int = 0
    # each slow step: its drafts (0: a plain step), ms it took, ms its costs say, its position
    slow: list[tuple[int, float, float, int]] = field(default_factory=list)

    def add(self, other: Split) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class Row:
    pair: str
    method: str
    temperature: float
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    from_draft: int = 0
    cut: int = 0  # draft-model chains ended short of the length asked (`DraftGate`)
    split: Split = field(default_factory=Split)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def slow_steps(self) -> int:
        """mlxd steps over SLOW x their measured cost (catch-ups, compiles)."""
        return len(self.split.slow)

    @property
    def slow_excess(self) -> float:
        """Seconds those steps took beyond that cost."""
        return sum(took - expected for _, took, expected, _ in self.split.slow) / 1e3

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def mlxd_run(
    target: nn.Module, draft: nn.Module, prompt: list[int], opts: SamplingOptions,
    method: str, tokens: int, costs: Costs, max_k: int | None, seed: int, history: SpecHistory,
) -> tuple[int, int, int, int, Split]:  # fmt: skip
    """Tokens, drafted, accepted, the draft model's chains its gate ended early, and where the
    time went (with the steps that took over `SLOW` times what the measured costs say they
    should: a trial's catch-up, a shape's first forward)."""
    rng = Rng(seed)
    source: DraftSource | None = None
    controller = None
    draft_cost = costs.draft_step
    if method == "model":
        source = ModelDraftSource(draft, opts, rng, costs)
    elif method in ("lookup", "lookup/4", "lookup/read"):
        source, draft_cost = LookupDraftSource(), 0.0
    elif method == "auto":
        source = HybridDraftSource(LookupDraftSource(), ModelDraftSource(draft, opts, rng, costs))
    if source is not None:
        cap = draft_cap(max_k, None, free=draft_cost == 0)  # as the server caps it
        controller = DraftLengthController(
            costs, cap, draft_cost, history=history, source=source.name, regime=opts.regime,
            free_k=draft_cap(max_k, None, free=True),
        )  # fmt: skip
    gen = Generation(target, prompt, opts, set(), tokens, rng, source, controller)
    most, behind = branches.MAX_BRANCHES, generation.ROUND_BEHIND
    branches.MAX_BRANCHES = 4 if method == "lookup/4" else most
    generation.ROUND_BEHIND = behind and method != "lookup/read"
    split = Split()
    try:
        t0 = time.perf_counter()
        gen.prefill()
        split.prefill = time.perf_counter() - t0
        n = 0
        step = iter(gen)
        while True:
            before, t0 = gen.stats.drafted, time.perf_counter()
            new = next(step, None)
            took = time.perf_counter() - t0
            if new is None:
                break
            n += len(new)
            k = gen.stats.drafted - before  # what the step should cost, by the measured costs
            expected = costs.v(k + 1) + k * draft_cost if k else costs.plain
            if took > SLOW * expected:
                split.slow.append((k, took * 1e3, expected * 1e3, gen.produced))
            if k:
                split.rounds += 1
                split.round_seconds += took
                split.round_tokens += len(new)
            else:
                split.plain_steps += 1
                split.plain_seconds += took
        model = source.model_part() if source is not None else None
        cut = model.cut if model is not None else 0
        return n, gen.stats.drafted, gen.stats.accepted, cut, split
    finally:
        branches.MAX_BRANCHES, generation.ROUND_BEHIND = most, behind
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


SLOW = 3.0  # a step over this many times its measured cost is reported as slow

FAT_TARGET = "3584,28,18944"  # hidden, layers, MLP: a Qwen2.5-7B-like target
FAT_DRAFT = "896,24,4864"  # a Qwen2.5-0.5B-like draft
OURS = [
    "plain (mlxd)", "mlxd model", "mlxd lookup", "mlxd lookup/read", "mlxd lookup/4", "mlxd auto"
]  # fmt: skip
METHODS = ["mlxd model", "mlxd lookup", "mlxd auto"]  # what a request picks; the rest compare


def fat_pair(code: Path, work: Path, target: str, draft: str, bits: int) -> Path:
    """The code pair fattened to the given shapes (built once under `work`, then reused)."""
    name = f"fat-{'bf16' if not bits else f'{bits}bit'}-{target.replace(',', 'x')}"
    out = work / name
    fatten = code.parent / "fatten.py"
    for role, shape in (("target", target), ("draft", draft)):
        dest = out / role
        if (dest / "config.json").is_file():
            continue
        hidden, layers, mlp = shape.split(",")
        cmd = [sys.executable, str(fatten), str(code / role), str(dest), "--hidden", hidden,
               "--layers", layers, "--intermediate", mlp]  # fmt: skip
        if bits:
            cmd += ["--bits", str(bits)]
        print(f"building {dest} ...", flush=True)
        subprocess.run(cmd, check=True)
    heldout = out / "heldout_prompts.json"
    if not heldout.is_file():
        heldout.write_bytes((code / "heldout_prompts.json").read_bytes())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pair", type=Path, default=Path(__file__).resolve().parents[2] / "shared/models/code-pair"
    )
    ap.add_argument("--fat", action="store_true", help="also the fat pairs (bf16 and 4-bit)")
    ap.add_argument("--pairs", default=None, help="which of code,fat-bf16,fat-4bit to run")
    ap.add_argument("--fat-target", default=FAT_TARGET, help="hidden,layers,MLP")
    ap.add_argument("--fat-draft", default=FAT_DRAFT, help="hidden,layers,MLP")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mlxd-fat")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--ks", default="2,3,4,5,6", help="mlx-lm's draft lengths ('' for none)")
    ap.add_argument(
        "--max-k",
        type=int,
        default=None,
        help="mlxd's draft_num_predict (the adaptive maximum; default: the server's, by method)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    names = (args.pairs or ("code,fat-bf16,fat-4bit" if args.fat else "code")).split(",")
    rows: list[Row] = []
    for name in names:
        if name == "code":
            path = args.pair
        elif name in ("fat-bf16", "fat-4bit"):
            bits = 4 if name == "fat-4bit" else 0
            path = fat_pair(args.pair, args.work, args.fat_target, args.fat_draft, bits)
        else:
            raise SystemExit(f"unknown pair {name!r}: choose from code, fat-bf16, fat-4bit")
        rows += bench_pair(name, path, args)
        gc.collect()
        mx.clear_cache()
    summary(rows, [float(t) for t in args.temps.split(",")], names)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    asdict(r)
                    | {"rate": r.rate, "slow_steps": r.slow_steps, "slow_excess": r.slow_excess}
                    for r in rows
                ],
                indent=1,
            )
        )


def bench_pair(pair: str, path: Path, args: argparse.Namespace) -> list[Row]:
    # Both engines decode the models as mlxd loads them (float32 on the CPU).
    target, tokenizer, _ = load_model(path / "target", BACKEND)
    draft = load_model(path / "draft", BACKEND)[0]
    heads = json.loads((path / "heldout_prompts.json").read_text())["code"][: args.prompts]
    prompts = [list(tokenizer.encode(h["prompt"])) for h in heads]
    costs = measure_costs(target, draft)
    print(f"\n== {pair}: {path}")
    print(f"device: {mx.default_device()}  prompts: {len(prompts)}  new tokens: {args.tokens}")
    print("measured verify cost v(L) = t(L)/t(1): " + " ".join(
        f"{w}:{costs.v(w) / costs.v(1):.2f}" for w in sorted(costs.verify)
    ) + f"  draft step / target step: {costs.draft_step / costs.v(1):.3f}"
      + f"  plain decoding: {costs.plain * 1e3:.2f} ms/token")  # fmt: skip

    # Warm up mlxd's paths once (kernel compiles, allocator), as its probe-open does.
    warm_up(target, draft, costs, args.max_k)

    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    temps = [float(t) for t in args.temps.split(",")]
    # mlx-lm's plain decoding takes turns with mlxd's methods on each prompt: plain against plain
    # is the closest comparison, so a slow spell of the machine must hit both alike.
    first = [*OURS, "mlx-lm plain"]
    theirs = [f"mlx-lm k={k}" for k in ks]
    table = {(t, name): Row(pair, name, t, 0, 0.0) for t in temps for name in first + theirs}
    history = SpecHistory()  # one pairing's history, as the server keeps it across requests

    def run(name: str, prompt: list[int], seed: int, temp: float) -> tuple[int, ...]:
        if name.startswith("mlx-lm"):
            k = int(name.split("=")[1]) if "=" in name else 0
            return mlxlm_run(target, draft if k else None, prompt, temp, k, args.tokens)
        method = "off" if name == "plain (mlxd)" else name.removeprefix("mlxd ")
        opts = parse_options({"temperature": temp, "top_k": 0, "top_p": 1.0})
        return mlxd_run(
            target, draft, prompt, opts, method, args.tokens, costs, args.max_k, seed, history
        )

    # Each prompt is read once by each engine before anything is timed: a prompt's first
    # prefill (a new length on a GPU) would otherwise land in whichever method comes first.
    greedy = parse_options({"temperature": 0})
    for prompt in prompts:
        mlxd_run(target, draft, prompt, greedy, "off", 2, costs, args.max_k, 0, history)
        mlxlm_run(target, None, prompt, 0.0, 0, 2)
    # Within each engine, methods take turns on each prompt, so a slow spell of the machine hits
    # them alike. The engines run one after the other: mlx-lm's verify forwards land on a new
    # cache length every round, hundreds of new CUDA graphs per prompt, which crowd MLX's graph
    # and buffer caches under whatever runs next.
    for group in (first, theirs):
        for temp in temps if group else []:
            for k in [0] if group is first else ks:  # mlx-lm's samplers and shapes, once
                mlxlm_run(target, draft if k else None, prompts[0][:16], temp, k, 2 * k + 2)
            for i, prompt in enumerate(prompts):
                for name in group:
                    row = table[temp, name]
                    mx.random.seed(i)
                    t0 = time.perf_counter()
                    out = run(name, prompt, i, temp)
                    row.seconds += time.perf_counter() - t0
                    row.tokens += out[0]
                    if name.startswith(("mlxd", "plain")):
                        row.drafted += out[1]
                        row.accepted += out[2]
                        row.cut += int(out[3])
                        row.split.add(out[4])
                    elif len(out) > 1:
                        row.from_draft += out[1]
            done = ", ".join(f"{name} {table[temp, name].rate:.1f}" for name in group)
            print(f"temperature {temp}: {done} tok/s", flush=True)  # survives a cut-short run
    rows = list(table.values())
    for temp in temps:
        report([r for r in rows if r.temperature == temp], temp)
    return rows


def summary(rows: list[Row], temps: list[float], pairs: list[str]) -> None:
    """One line per pair and temperature: plain's rate, the rest as ratios to it."""
    others = ["mlx-lm plain", *OURS[1:]]
    print(f"\n{'pair':<10}{'temp':>6}{'plain tok/s':>13}" + "".join(f"{o:>17}" for o in others))
    floor = float("inf")
    for pair in pairs:
        for temp in temps:
            by = {r.method: r.rate for r in rows if r.pair == pair and r.temperature == temp}
            plain = by["plain (mlxd)"]
            ratios = [by[o] / plain if plain else 0.0 for o in others]
            floor = min(floor, *(by[o] / plain if plain else 0.0 for o in METHODS))
            cells = "".join(f"{x:>16.2f}x" for x in ratios)
            print(f"{pair:<10}{temp:>6}{plain:>13.1f}{cells}")
    print(f"slowest mlxd method ({', '.join(METHODS)}) / plain over every cell: {floor:.2f}x")


def report(rows: list[Row], temp: float) -> None:
    plain = next(r for r in rows if r.method == "plain (mlxd)").rate
    print(f"\ntemperature {temp}")
    print(
        f"{'method':<16}{'tok/s':>9}{'vs plain':>10}{'acceptance':>12}{'from draft':>12}"
        f"{'slow steps':>12}{'their excess':>14}{'cut chains':>12}"
    )
    for r in rows:
        acc = f"{r.acceptance:.3f}" if r.drafted else "-"
        share = f"{r.from_draft / r.tokens:.3f}" if r.from_draft else (
            f"{r.accepted / r.tokens:.3f}" if r.drafted else "-"
        )  # fmt: skip
        ours = r.method.startswith(("mlxd", "plain"))
        slow = f"{r.slow_steps:>12}{r.slow_excess / r.seconds:>13.1%}{r.cut:>12}" if ours else ""
        print(f"{r.method:<16}{r.rate:>9.1f}{r.rate / plain:>9.2f}x{acc:>12}{share:>12}{slow}")
    print(
        f"(slow steps: mlxd steps over {SLOW:g}x what the measured costs say (a plain step, or k"
        " draft steps and a (k+1)-token verify), e.g. a draft catching up or a shape's first"
        " forward; their excess: the time beyond that, as a share of the method's; cut chains:"
        " draft-model chains ended short of the length asked, where one more draft could not pay)"
    )
    print(
        f"{'where the time went':<20}{'prefill ms':>11}{'plain steps':>12}{'ms each':>9}"
        f"{'rounds':>8}{'ms each':>9}{'tokens each':>12}{'ms/token':>10}"
    )
    for r in rows:
        if r.method.startswith(("mlxd", "plain")):
            sp = r.split
            each = sp.plain_seconds / sp.plain_steps * 1e3 if sp.plain_steps else 0.0
            rnd = sp.round_seconds / sp.rounds * 1e3 if sp.rounds else 0.0
            per = sp.round_tokens / sp.rounds if sp.rounds else 0.0
            tok = sp.round_seconds / sp.round_tokens * 1e3 if sp.round_tokens else 0.0
            print(
                f"{r.method:<20}{sp.prefill * 1e3:>11.1f}{sp.plain_steps:>12}{each:>9.2f}"
                f"{sp.rounds:>8}{rnd:>9.2f}{per:>12.2f}{tok:>10.2f}"
            )
    print("(prefill: every prompt's, summed; a round's ms/token: its time per committed token)")
    for r in rows:
        if r.split.slow:
            by_k: dict[int, int] = {}
            for k, *_ in r.split.slow:
                by_k[k] = by_k.get(k, 0) + 1
            worst = sorted(r.split.slow, key=lambda x: -x[1])[:3]
            print(
                f"slow steps of {r.method}, by drafts: "
                + " ".join(f"{k}:{n}" for k, n in sorted(by_k.items()))
                + "; slowest (drafts, ms, ms expected, tokens out): "
                + ", ".join(f"({k}, {t:.1f}, {e:.1f}, {at})" for k, t, e, at in worst)
            )
    ours = max((r for r in rows if r.method.startswith("mlxd")), key=lambda r: r.rate)
    spec = [r for r in rows if r.method.startswith("mlx-lm k=")]
    floor = min(r.rate for r in rows if r.method in METHODS) / plain
    best = ""
    if spec:
        theirs = max(spec, key=lambda r: r.rate)
        best = f"best mlxd ({ours.method}) / best mlx-lm ({theirs.method}): "
        best += f"{ours.rate / theirs.rate:.2f}x   "
    lm_plain = next(r for r in rows if r.method == "mlx-lm plain").rate
    print(
        f"{best}slowest mlxd method / plain: {floor:.2f}x"
        f"   mlx-lm plain / mlxd plain: {lm_plain / plain:.2f}x"
    )


if __name__ == "__main__":
    main()
