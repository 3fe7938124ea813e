"""A model's decode step as mlx-lm runs it against the compiled step (`engine.compiledstep`).

    python bench/compiled_step.py --model DIR [--model DIR ...] [--context 512] [--steps 64]

For each model, loaded as mlxd loads it, a chain of `--steps` greedy decode steps after a
`--context`-token prompt, each step's token fed to the next without a host read (as a draft
chain runs), in milliseconds per step: built and encoded while the previous one runs
(`chained`), and each waited for before the next (`alone`, a chain whose draft confidence is
read every step), with the host's share (building and `mx.async_eval`). The two paths' tokens
are compared. Then batches of `--rows` rows (left-padded, as a continuous batch holds them)
stepped chained, and forwards of `--widths` tokens (a verify round's), each waited for. The
first compiled chain's time (traces and kernel builds) is printed apart.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

BACKEND = configure_backend()

# isort: split
import mlx.core as mx
import mlx.nn as nn

from mlxd.engine import compiledstep
from mlxd.engine.kvcache import batch_type, make_cache
from mlxd.engine.pairing import load_model
from mlxd.engine.prefill import feed

Step = Callable[[nn.Module, list[Any], mx.array], mx.array]


def eager(model: nn.Module, cache: list[Any], tok: mx.array) -> mx.array:
    return model(tok, cache=cache)


def compiled(model: nn.Module, cache: list[Any], tok: mx.array) -> mx.array:
    return compiledstep.forward(model, cache, tok, compiled=True)


def cache_of(model: nn.Module, prompt: list[int], rows: int) -> tuple[list[Any], mx.array]:
    """A cache holding `prompt` (a batch cache of `rows` rows, each a few tokens shorter than
    the one before, where rows > 1) and each row's greedy next token (rows, 1)."""
    lone = [make_cache(model) for _ in range(rows)]
    firsts = [feed(model, c, prompt[: len(prompt) - 3 * r]) for r, c in enumerate(lone)]
    tok = mx.argmax(mx.concatenate(firsts), axis=-1).reshape(rows, 1)
    if rows == 1:
        cache = lone[0]
    else:
        kind = batch_type(model)
        cache = [kind.merge([c[i] for c in lone]) for i in range(len(lone[0]))]
    mx.eval(tok, [c.state for c in cache])
    return cache, tok


def chain(
    model: nn.Module, prompt: list[int], steps: int, step: Step, wait: bool, rows: int = 1
) -> Any:
    """(ms a step, host ms a step, tokens) of `steps` greedy steps of `rows` rows."""
    cache, tok = cache_of(model, prompt, rows)
    toks, host = [tok], 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        h0 = time.perf_counter()
        tok = mx.argmax(step(model, cache, tok)[:, -1, :], axis=-1).reshape(rows, 1)
        mx.async_eval(tok)
        host += time.perf_counter() - h0
        if wait:
            mx.eval(tok)
        toks.append(tok)
    mx.eval(toks)
    ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, host / steps * 1e3, mx.concatenate(toks, axis=1).tolist()


def verify(model: nn.Module, prompt: list[int], width: int, reps: int, step: Step) -> float:
    """ms of a `width`-token forward after `prompt`, each waited for and trimmed away (a
    verify round's forward), after two unmeasured ones."""
    cache = make_cache(model)
    feed(model, cache, prompt)
    mx.eval([c.state for c in cache])
    tokens = mx.array([prompt[-width:]], dtype=mx.uint32)
    total = 0.0
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mx.eval(step(model, cache, tokens), [c.state for c in cache])
        if i >= 2:
            total += time.perf_counter() - t0
        for layer in cache:
            layer.trim(width)
    return total / reps * 1e3


def measure(path: Path, context: int, steps: int, widths: list[int], rows: list[int]) -> None:
    model, _, _ = load_model(path, BACKEND)
    prompt = [(i * 7919) % 1000 + 3 for i in range(context)]
    t0 = time.perf_counter()
    chain(model, prompt, steps, compiled, wait=False)
    first = (time.perf_counter() - t0) * 1e3
    chain(model, prompt, 4, eager, wait=False)  # eager's kernels built too
    print(
        f"\n{path.name}: {context}-token context, {steps} steps; first compiled chain {first:.0f} ms"
    )
    print("mode      eager ms (host)   compiled ms (host)   compiled / eager")
    for wait in (False, True):
        e_ms, e_host, e_toks = chain(model, prompt, steps, eager, wait)
        c_ms, c_host, c_toks = chain(model, prompt, steps, compiled, wait)
        same = sum(a == b for a, b in zip(e_toks[0], c_toks[0], strict=True))
        label = "alone" if wait else "chained"
        print(
            f"{label:8s}  {e_ms:7.2f} ({e_host:5.2f})    {c_ms:7.2f} ({c_host:5.2f})"
            f"       {c_ms / e_ms:5.2f}x   tokens equal {same}/{len(e_toks[0])}"
        )
    for n in rows:
        chain(model, prompt, 4, compiled, False, n)  # its trace and kernels
        e_ms, e_host, e_toks = chain(model, prompt, steps, eager, False, n)
        c_ms, c_host, c_toks = chain(model, prompt, steps, compiled, False, n)
        same = int((mx.array(e_toks) == mx.array(c_toks)).sum().item())
        print(
            f"{n} rows    {e_ms:7.2f} ({e_host:5.2f})    {c_ms:7.2f} ({c_host:5.2f})"
            f"       {c_ms / e_ms:5.2f}x   tokens equal {same}/{n * (steps + 1)}"
        )
    for width in widths:
        verify(model, prompt, width, 2, compiled)  # its trace and kernels
        e_ms = verify(model, prompt, width, steps // 4, eager)
        c_ms = verify(model, prompt, width, steps // 4, compiled)
        print(
            f"{width:2d} tokens  {e_ms:7.2f}            {c_ms:7.2f}                  {c_ms / e_ms:5.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--widths", default="2,4,8", help="forwards of several tokens, alone")
    ap.add_argument("--rows", default="4,8", help="batches stepped chained")
    args = ap.parse_args()
    print(BACKEND.describe())
    for path in args.model:
        widths = [int(w) for w in args.widths.split(",") if w]
        measure(path, args.context, args.steps, widths, [int(r) for r in args.rows.split(",") if r])


if __name__ == "__main__":
    main()
