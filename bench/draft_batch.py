"""Batched drafting vs drafting row by row: seconds per round of k drafts for B rows.

    python bench/draft_batch.py [--draft DIR] [--rows 1,2,4,8] [--k 4] [--context 128]

Each round every row drafts k tokens from the draft model and accepts a varying number of them
(so rows miss 1 or 2 committed tokens at the next round and the batch rolls), once through one
`DraftBatch` (one forward per draft step for all rows) and once through each row's own
`ModelDraftSource` (k forwards per row). It also prints what the batch's catch-up costs: a
B-row forward of width 1 and of width 2 (re-reading one token, what a row that missed less
than another pays) and one roll of the batch cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from mlxd.engine.draftbatch import DraftBatch, trim_rows
from mlxd.engine.drafting import ModelDraftSource
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng, to_ints

ROOT = Path(__file__).resolve().parent.parent


def rows_of(
    model: object, rows: int, context: int
) -> tuple[list[ModelDraftSource], list[list[int]]]:
    greedy = parse_options({"temperature": 0})
    sources = [ModelDraftSource(model, greedy, Rng(i)) for i in range(rows)]  # type: ignore[arg-type]
    tokens = [[(7 * i + j) % 500 + 3 for j in range(context + i)] for i in range(rows)]
    for s, t in zip(sources, tokens, strict=True):
        s.prefill(t)
    return sources, tokens


def commit(tokens: list[int], drafted: list[int], r: int, i: int) -> list[int]:
    accepted = (r + i) % (len(drafted) + 1)
    return [*tokens, *drafted[:accepted], (drafted[min(accepted, len(drafted) - 1)] + 1) % 500]


def run(model: object, rows: int, k: int, context: int, rounds: int, batched: bool) -> float:
    sources, tokens = rows_of(model, rows, context)
    batch = DraftBatch(model)  # type: ignore[arg-type]
    if batched:
        batch.join(sources)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        if batched:
            drafts = batch.propose(tokens, [k] * rows)
        else:
            drafts = [s.propose(t, k) for s, t in zip(sources, tokens, strict=True)]
        mx.eval([d.tokens for d in drafts])
        for i, (s, d) in enumerate(zip(sources, drafts, strict=True)):
            tokens[i] = commit(tokens[i], to_ints(d.tokens), r, i)
            s.accept(tokens[i])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def parts(model: object, rows: int, context: int, passes: int = 9) -> dict[str, float]:
    sources, _ = rows_of(model, rows, context)
    batch = DraftBatch(model)  # type: ignore[arg-type]
    batch.join(sources)
    out: dict[str, list[float]] = {"width 1": [], "width 2": [], "roll": []}
    for _ in range(passes):
        for width in (1, 2):
            t0 = time.perf_counter()
            mx.eval(model(mx.zeros((rows, width), dtype=mx.uint32), cache=batch.cache))  # type: ignore[operator]
            out[f"width {width}"].append(time.perf_counter() - t0)
            trim_rows(batch.cache, [width] * rows, rows)
        mx.eval(model(mx.zeros((rows, 1), dtype=mx.uint32), cache=batch.cache))  # type: ignore[operator]
        t0 = time.perf_counter()
        trim_rows(batch.cache, [1] + [0] * (rows - 1), rows)
        mx.eval([c.state for c in batch.cache])
        out["roll"].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    near = [up / "shared/models/code-pair/draft" for up in (ROOT.parent, ROOT.parent.parent)]
    ap.add_argument("--draft", type=Path, default=next((d for d in near if d.is_dir()), near[0]))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    model = load(str(args.draft))[0]
    print(f"draft {args.draft}  k {args.k}  context {args.context}  (ms per round)")
    print(f"{'rows':>5} | {'batched':>8} {'per row':>8} {'ratio':>6} | "
          f"{'width 1':>8} {'width 2':>8} {'roll':>6}")  # fmt: skip
    for rows in [int(r) for r in args.rows.split(",")]:
        together = run(model, rows, args.k, args.context, args.rounds, True)
        alone = run(model, rows, args.k, args.context, args.rounds, False)
        p = parts(model, rows, args.context)
        print(
            f"{rows:>5} | {together * 1e3:>8.2f} {alone * 1e3:>8.2f} {alone / together:>5.2f}x | "
            f"{p['width 1'] * 1e3:>8.2f} {p['width 2'] * 1e3:>8.2f} {p['roll'] * 1e3:>6.2f}"
        )


if __name__ == "__main__":
    main()
