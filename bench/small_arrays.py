"""A lone row's decode step with RoPE's offsets in MLX's CUDA scalar pool or out of it.

    python bench/small_arrays.py --model PATH [--tokens 128] [--repeats 3]

MLX's CUDA allocator hands arrays of 8 bytes or less out of one pool of read-mostly managed
memory, and kernels reading one there ran slowly on an H200 (a lone adapted row's slot index:
1.64x the base's step over 16 7B-shaped blocks against 1.15x out of it; `engine/smallarrays.py`).
mlx-lm's models give RoPE the cache's int offset, which MLX turns into a 4-byte array per call:
two a layer, every step. This times greedy decoding of one prompt, pipelined as mlx-lm's
`generate_step` does (each token's forward queued before the previous token is read), arms
alternating over `--repeats`:

- `pooled`: the model as mlx-lm runs it;
- `offsets 16 B`: every RoPE call given the step's offset as a view of a 16-byte array
  (`kernel_array`), made once per step and shared by the layers.

Prints ms per token and the ratio, and checks that both arms decode the same tokens.
"""

# ruff: noqa: E402  (the backend is configured before MLX is imported)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxd.engine.backend import configure_backend

configure_backend()

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxd.engine.smallarrays import kernel_array


class DeviceOffsetRope:
    """A model's RoPE given int offsets as arrays backed by 16 bytes, one per offset, shared
    by every layer of the step."""

    def __init__(self, rope: Any, shared: dict[int, mx.array]) -> None:
        self.rope, self.shared = rope, shared

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if isinstance(offset, int):
            found = self.shared.get(offset)
            if found is None:
                self.shared.clear()
                found = self.shared[offset] = kernel_array([offset], mx.int32)
            offset = found
        return self.rope(x, offset=offset)


def ropes_of(model: nn.Module) -> list[Any]:
    """The attention modules holding a `rope`, for mlx-lm's llama-like models."""
    return [layer.self_attn for layer in model.layers if hasattr(layer.self_attn, "rope")]


def decode(model: nn.Module, prompt: mx.array, tokens: int) -> tuple[list[int], float]:
    """(tokens, ms per token after the first) of greedy pipelined decoding."""
    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[0, -1])
    mx.eval(y)
    out = [y.item()]
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        nxt = mx.argmax(model(y.reshape(1, 1), cache=cache)[0, -1])
        mx.async_eval(nxt)
        out.append(y.item())
        y = nxt
    out.append(y.item())
    return out[:tokens], (time.perf_counter() - t0) / (tokens - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, _ = load(args.model)
    vocab = model.model.embed_tokens.weight.shape[0]
    prompt = mx.array([(7 * i + 3) % vocab for i in range(64)], dtype=mx.uint32)
    attns = ropes_of(model)
    stock = [a.rope for a in attns]
    shared: dict[int, mx.array] = {}
    wrapped = [DeviceOffsetRope(r, shared) for r in stock]

    def arm(ropes: list[Any]) -> tuple[list[int], float]:
        for a, r in zip(attns, ropes, strict=True):
            a.rope = r
        return decode(model, prompt, args.tokens)

    arm(stock), arm(wrapped)  # compiles and first shapes, unmeasured
    ms: dict[str, list[float]] = {"pooled": [], "offsets 16 B": []}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, ropes in (("pooled", stock), ("offsets 16 B", wrapped)):
            tokens, per = arm(ropes)
            ms[name].append(per)
            outputs.setdefault(name, tokens)
    same = outputs["pooled"] == outputs["offsets 16 B"]
    base = statistics.median(ms["pooled"])
    print(f"model {args.model}  tokens {args.tokens}  repeats {args.repeats}  same tokens: {same}")
    for name, values in ms.items():
        mid = statistics.median(values)
        print(f"{name:>14}: {mid:6.2f} ms/token  ({base / mid:.3f}x)  runs {values}")
    if not same:
        raise SystemExit("the arms decoded different tokens")


if __name__ == "__main__":
    main()
