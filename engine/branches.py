"""Several drafts verified in one target forward: branches of [pending] + L drafts side by side.

Prompt lookup often knows more than one continuation: the trailing n-gram occurred several times,
followed by different text. Where a target forward of m(L+1) tokens costs about what one of L+1
costs (a GPU's flat verify curve), verifying every candidate in the same forward commits the
longest of them for the price of one. The branches are laid out as one sequence of m(L+1)
tokens (a `Grid`) that the model runs unmodified, but for the forward's duration (`laid_out`):

- each token attends to the cache and to the earlier tokens of its own branch only: the cache's
  own causal mask with the other branches' new keys masked out;
- RoPE sees the sequence as (m, L+1), so every branch sits at the positions it would alone.

So each branch's logits are those of a verify forward over it alone, and acceptance stays
lossless (`verify.verify_grid`). Afterwards the winning branch's keys are moved to follow the
committed ones and the rest are trimmed (`keep_branch`): the cache ends as if only that branch
had been verified.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import trim_prompt_cache

from mlxd.engine.kvcache import make_cache, plain_kv
from mlxd.engine.prefill import feed

__all__ = ["MAX_BRANCHES", "Grid", "branchable", "grid_of", "keep_branch", "laid_out"]

# the most branches a round verifies (`MLXD_BRANCHES`); 1, the default, verifies the source's
# own draft only: on an H200 (fat bf16 pair, 8 held-out code prompts, four machine starts)
# prompt lookup with up to 4 branches ran at 1.68-1.80x plain decoding greedy against 1.73-1.89x
# with one, the grid rounds' extra masking and RoPE costing more than their rare wins saved
MAX_BRANCHES = max(1, int(os.environ.get("MLXD_BRANCHES", "1")))
_OWNERS = "mlxd_rope_owners"


@dataclass(frozen=True)
class Grid:
    """m branches, each the pending token then L drafted tokens (the first branch: the
    source's own draft, the rest its alternatives, cut or padded to L)."""

    pending: int
    drafts: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.drafts)

    @property
    def length(self) -> int:
        return len(self.drafts[0])

    @property
    def width(self) -> int:
        """Tokens per branch: the pending one and its drafts."""
        return self.length + 1

    @property
    def tokens(self) -> list[int]:
        return [t for drafts in self.drafts for t in (self.pending, *drafts)]


def grid_of(pending: int, first: Sequence[int], others: Sequence[Sequence[int]]) -> Grid:
    """The grid of `first` (L drafts) and the other candidates that differ from it within L
    tokens, each cut to L, or padded with its own last token (a padded position is verified as
    any draft: accepted only where it is the target's own choice)."""
    length = len(first)
    rows = [tuple(first)]
    for other in others:
        cut = tuple(other[:length])
        if not cut:
            continue
        row = cut + (cut[-1],) * (length - len(cut))
        if row not in rows:
            rows.append(row)
    return Grid(pending, tuple(rows))


class _Owners:
    """The modules of a model that hold a `rope`, and whether a grid forward of the model was
    seen to reproduce separate forwards (a plain attribute: not part of the module tree)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules
        self.checked: bool | None = None


def _owners(model: nn.Module) -> _Owners:
    """`model`'s; a target that is not one module (a distributed one's ranks) holds none."""
    held = getattr(model, _OWNERS, None)
    if held is None:
        tree = model.named_modules() if isinstance(model, nn.Module) else []
        held = _Owners([m for _, m in tree if isinstance(m.get("rope"), nn.Module)])
        setattr(model, _OWNERS, held)
    return held


def _rope_owners(model: nn.Module) -> list[nn.Module]:
    return _owners(model).modules


CHECK = grid_of(3, [5, 7, 2], [[4, 4, 6], [1, 2, 3]])  # a layout tried once per model
CHECK_CONTEXT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
CHECK_TOLERANCE = 0.05  # of the logits' largest magnitude: kernels of other widths round apart


def reproduces(model: nn.Module) -> bool:
    """Whether `CHECK`'s grid forward gives every branch the logits of a forward over it alone:
    the layout assumes an attention that ropes (B, H, T, D) queries and keys by the cache's
    offset and masks by the cache's mask, which a model of another make may not. Once per
    model; False for a model that cannot run it."""
    held = _owners(model)
    if held.checked is None:
        try:
            held.checked = _reproduces(model)
        except Exception:  # a model the layout does not fit
            held.checked = False
    return held.checked


def _reproduces(model: nn.Module) -> bool:
    def read() -> list[Any]:
        cache = make_cache(model)
        feed(model, cache, CHECK_CONTEXT)
        return cache

    cache = read()
    with laid_out(model, cache, CHECK):
        together = model(mx.array([CHECK.tokens]), cache=cache)[0].astype(mx.float32)
    width = CHECK.width
    for b, drafts in enumerate(CHECK.drafts):
        alone = model(mx.array([[CHECK.pending, *drafts]]), cache=read())[0]
        alone = alone.astype(mx.float32)
        error = mx.max(mx.abs(together[b * width : (b + 1) * width] - alone))
        if (error > CHECK_TOLERANCE * mx.max(mx.abs(alone))).item():
            return False
    return True


def branchable(model: nn.Module, cache: Sequence[Any]) -> bool:
    """Whether a forward of `model` over `cache` can verify branches: plain K/V layers, every
    one of them under an attention whose RoPE can be laid out per branch, and a model whose
    grid forwards were seen to reproduce separate ones (`reproduces`)."""
    if not cache or not all(plain_kv(c) for c in cache):
        return False
    return len(_rope_owners(model)) == len(cache) and reproduces(model)


class _BranchRoPE(nn.Module):
    """RoPE over (B, H, m(L+1), D) as m branches of L+1 positions each."""

    def __init__(self, inner: nn.Module, branches: int) -> None:
        super().__init__()
        self.inner = inner
        self.branches = branches

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        b, h, t, d = x.shape
        laid = x.reshape(b, h, self.branches, t // self.branches, d)
        return self.inner(laid, offset=offset).reshape(b, h, t, d)


def branch_mask(own: mx.array, offset: int, width: int) -> mx.array:
    """`own` (the cache's causal mask over a forward's n rows, boolean (n, keys)) with every
    new key of another branch masked out; branches are `width` tokens each, from `offset`."""
    rows = mx.arange(own.shape[-2])[:, None] // width
    new = mx.arange(own.shape[-1])[None, :] - offset
    other = (new >= 0) & (mx.maximum(new, 0) // width != rows)
    return own & ~other


@contextlib.contextmanager
def laid_out(model: nn.Module, cache: Sequence[Any], grid: Grid) -> Iterator[None]:
    """Within: forwards of `model` over `cache` built here see `grid`'s layout (masks and
    positions per branch). Only the building of the graph happens here; it evaluates later."""
    owners = _rope_owners(model)
    ropes = [m["rope"] for m in owners]
    offset = int(cache[0].offset)

    def mask_for(layer: Any) -> Any:
        own = layer.make_mask

        def make_mask(n: int, return_array: bool = False, window_size: int | None = None) -> Any:
            return branch_mask(
                own(n, return_array=True, window_size=window_size), offset, grid.width
            )

        return make_mask

    for layer in cache:
        layer.make_mask = mask_for(layer)
    for module, rope in zip(owners, ropes, strict=True):
        module.rope = _BranchRoPE(rope, grid.count)
    try:
        yield
    finally:
        for module, rope in zip(owners, ropes, strict=True):
            module.rope = rope
        for layer in cache:
            del layer.make_mask


def keep_branch(cache: Sequence[Any], start: int, branch: int, width: int, keep: int) -> None:
    """The cache holds a grid's keys from `start` (branches of `width`): keep the first `keep`
    of branch `branch`'s, right after `start`, and drop the rest."""
    if branch:
        source = start + branch * width
        for layer in cache:
            layer.keys[..., start : start + keep, :] = layer.keys[..., source : source + keep, :]
            layer.values[..., start : start + keep, :] = layer.values[
                ..., source : source + keep, :
            ]
    extra = int(cache[0].offset) - start - keep
    if extra:
        trim_prompt_cache(list(cache), extra)
