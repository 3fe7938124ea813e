"""The host's side of a grammar row, step by step: the decoding thread's CPU time per step of
plain decoding and of grammar decoding (forced and free tokens apart), and the parts of a
grammar step timed alone. Medians over many steps, so a busy machine blurs them little.

    python bench/grammar_host.py [--pair /work/shared/models/code-pair | --tiny]

On a fast GPU a step costs its forward or the host's work for it, whichever is longer: the
host time that grammar decoding adds to a plain step is what it can cost there.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()

# isort: split
import mlx.core as mx
import numpy as np
from grammar import SCHEMAS  # type: ignore[import-not-found]

from mlxd.engine.generation import Generation
from mlxd.engine.grammar import GrammarSpec, Matcher, bias_of, logits_width
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import load_model
from mlxd.engine.prompt import render_chat
from mlxd.engine.sampling import Rng, next_tokens


def single(row: np.ndarray) -> bool:
    nonzero = np.flatnonzero(row)
    return len(nonzero) == 1 and bin(int(row[nonzero[0]]) & 0xFFFFFFFF).count("1") == 1


def steps(gen: Generation, m: Matcher | None) -> list[tuple[str, float]]:
    """(kind, host seconds) for every step: "plain", or "forced"/"free" by the step's mask."""
    out = []
    seen: list[bool] = []
    if m is not None:
        inner = m.mask_into

        def watched(buf: np.ndarray) -> None:
            inner(buf)
            seen.append(single(buf))

        m.mask_into = watched  # type: ignore[method-assign]
    while not gen.done:
        seen.clear()
        h0 = time.thread_time()
        gen.step()
        host = time.thread_time() - h0
        kind = "plain" if m is None else ("forced" if seen and seen[0] else "free")
        out.append((kind, host))
    return out


def median_us(fn: Callable[[], Any], n: int = 200) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pair", type=Path, default=Path("/work/shared/models/code-pair"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--schemas", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    pair = args.pair
    if args.tiny:
        from tests.fixtures.tiny_models import build_pair

        pair = build_pair(Path(tempfile.mkdtemp(prefix="mlxd-bench-"))).root
    target, tok, config = load_model(pair / "target", BACKEND)
    vocab, eos = logits_width(config, tok), set(tok.eos_token_ids)
    opts = parse_options({"temperature": args.temperature, "top_k": 0, "top_p": 1.0, "seed": 0})
    times: dict[str, list[float]] = {"plain": [], "forced": [], "free": []}
    for rep in range(2):  # the first pass warms every shape up
        for what, text, schema in SCHEMAS[: args.schemas]:
            ask = (
                f"Extract the {what} from this text as JSON matching {json.dumps(schema)}:\n{text}"
            )
            prompt = list(tok.encode(render_chat(tok, [{"role": "user", "content": ask}])))
            m = Matcher.build(GrammarSpec.schema(schema), tok, vocab, sorted(eos))
            gen = Generation(target, prompt, opts, eos, 160, Rng(0), grammar=m)
            gen.prefill()
            made = steps(gen, m)
            n = gen.produced
            gen.close()
            gen = Generation(target, prompt, opts, set(), n, Rng(0))
            gen.prefill()
            made += steps(gen, None)
            gen.close()
            if rep:
                for kind, host in made[1:]:  # the first step queues the first forward
                    times[kind].append(host)
    print(f"host ms per step (median, {args.schemas} schemas, temperature {args.temperature}):")
    for kind, ts in times.items():
        if ts:
            print(f"  {kind:<7}{statistics.median(ts) * 1e3:8.3f}   ({len(ts)} steps)")
    # the grammar's parts alone, on one matcher midway through an object
    schema = SCHEMAS[0][2]
    m = Matcher.build(GrammarSpec.schema(schema), tok, vocab, sorted(eos))
    m.consume(list(tok.encode('{"name": "Ada')))
    buf = m.bits()
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    rng = Rng(0)
    bias = bias_of(buf, vocab)
    parts = {
        "mask": lambda: m.mask_into(buf[0]),
        "bias (graph)": lambda: bias_of(buf, vocab),
        "bias (evaluated)": lambda: mx.eval(bias_of(buf, vocab)),
        "choice (graph)": lambda: next_tokens(logits, [], [], opts, rng, 9, bias),
        "consume+rollback": lambda: (m.consume([tok.encode("a")[0]]), m.rollback(1)),
    }
    print("parts, median microseconds:")
    for name, fn in parts.items():
        print(f"  {name:<18}{median_us(fn):8.1f}")


if __name__ == "__main__":
    main()
