"""What position-keyed sampling costs in draft acceptance, on a real target/draft pair.

    python bench/coupling.py [--pair DIR] [--prompts 8] [--tokens 32] [--noise 256]

mlxd samples the token at position t as argmax(log p_t + g_t) with Gumbel noise keyed by
(seed, t), the draft with the same g_t, and accepts a draft when the two choices agree; that is
what makes seeded output independent of speculation and batching. Classic speculative
sampling accepts with min(1, p/q) instead (the best any lossless rule can do for one draft
position, sum_x min(p, q)), and mlx-lm's rule compares independent samples (sum_x p q). For the
target's own continuations of held-out prompts, this prints the mean per-position acceptance
of the three at a few temperatures (the shared-noise rate estimated over `--noise` draws).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from mlxd.engine.options import parse_options
from mlxd.engine.sampling import probabilities

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", type=Path, default=ROOT.parent / "shared/models/code-pair")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--noise", type=int, default=256)
    args = ap.parse_args()
    target, tokenizer = load(str(args.pair / "target"))[:2]
    draft = load(str(args.pair / "draft"))[0]
    held = json.loads((args.pair / "heldout_prompts.json").read_text())
    prompts = [list(tokenizer.encode(p["prompt"])) for p in held["code"][: args.prompts]]
    sequences = []
    for prompt in prompts:  # the target's greedy continuation: contexts it really decodes in
        seq = list(prompt)
        for _ in range(args.tokens):
            seq.append(int(mx.argmax(target(mx.array([seq]))[0, -1]).item()))
        sequences.append((len(prompt), seq))
    print(f"pair {args.pair}  {len(prompts)} prompts x {args.tokens} positions")
    print(
        f"{'temp':>5} | {'min(1,p/q)':>10} {'shared noise':>12} {'independent':>11} | {'ratio':>6}"
    )
    for temperature in (0.3, 0.7, 1.0):
        opts = parse_options({"temperature": temperature, "top_k": 0, "top_p": 1.0})
        best = shared = independent = 0.0
        count = 0
        for start, seq in sequences:
            x = mx.array([seq[:-1]])
            p = probabilities(target(x)[0, start - 1 :], opts)
            q = probabilities(draft(x)[0, start - 1 :], opts)
            best += float(mx.sum(mx.minimum(p, q)))
            independent += float(mx.sum(p * q))
            agree = mx.zeros((p.shape[0],))
            for i in range(args.noise):
                g = mx.random.gumbel(shape=p.shape, key=mx.random.key(i))
                agree = agree + (
                    mx.argmax(mx.log(p) + g, axis=-1) == mx.argmax(mx.log(q) + g, axis=-1)
                )
                mx.eval(agree)
            shared += float(mx.sum(agree)) / args.noise
            count += p.shape[0]
        best, shared, independent = best / count, shared / count, independent / count
        print(
            f"{temperature:>5} | {best:>10.3f} {shared:>12.3f} {independent:>11.3f} | "
            f"{shared / best:>6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
