"""Run every gather and scatter kernel serving uses once at load (MLX's CUDA build).

MLX's CUDA build compiles a kernel module with NVRTC the first time a process runs a gather
or scatter of a new (values dtype, index dtype, index count): on an H100 host 3-20 s each.
From a cold cache, an 8B-shaped model's daemon met seven of them while serving: a 2-row verify
round took 18.4 s while three compiled, and the next request's first token 2.7 s. MLX keeps
what it compiled on disk (`MLX_PTX_CACHE_DIR`, which the backend points at the user's cache so
it outlives a reboot), so running each signature at load costs its compile once per machine
and milliseconds after; with it, the same cold start compiled nothing after load.

A signature is what decides the module: the operation, the kind of values (any float is run
in the model's dtypes and in float32, where logits and probabilities live), their rank and
the index's parts. `SERVED` lists those the engine's rounds, prompts, drafts, samplers and
caches use: `tests/engine/test_jitwarm.py` runs served workloads under a recorder of MLX's
indexing calls (adapters' too: `tests/adapters/test_jitwarm.py`) and fails on any signature
missing here; two (uint32 tokens by uint32 positions, and along an axis by int32 ones) were
seen compiled only on the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

Part = tuple[Any, ...]  # ("a", index dtype, rank) | ("s",) slice | ("i",) int | ("n",) | ("e",)
Signature = tuple[str, str, int, tuple[Part, ...]]  # op, values kind, values rank, parts

_DTYPES = {str(d).rsplit(".", 1)[-1]: d for d in (mx.int32, mx.uint32, mx.int64, mx.bool_)}

_I32, _U32 = ("a", "int32", 1), ("a", "uint32", 1)
SERVED: tuple[Signature, ...] = (
    ("get", "float", 1, (_I32,)),
    ("get", "float", 2, (_I32,)),
    ("get", "float", 2, (_U32,)),  # rows' adapters
    ("get", "float", 2, (("a", "uint32", 2),)),  # the embedding
    ("get", "float", 4, (_I32,)),  # a batch cache's rows
    ("get", "int32", 1, (_I32,)),
    ("get", "int32", 2, (("s",), ("a", "int32", 2))),  # the device's prompt lookup
    ("get", "uint32", 1, (_I32,)),
    ("get", "uint32", 1, (_U32,)),  # seen on the GPU only
    ("get", "uint32", 2, (_I32,)),
    ("set", "float", 1, (_I32,)),
    ("take:axis", "uint32", 2, (("a", "int32", 0),)),
    ("take:flat", "uint32", 1, (("a", "int32", 0),)),
    ("take_along_axis:axis", "float", 2, (("a", "int32", 2),)),
    ("take_along_axis:axis", "float", 2, (("a", "uint32", 2),)),
    ("take_along_axis:axis", "float", 4, (("a", "int32", 4),)),  # a batch cache's roll
    ("take_along_axis:axis", "int32", 2, (("a", "int32", 2),)),
    ("take_along_axis:axis", "uint32", 2, (("a", "int32", 2),)),  # seen on the GPU only
)


def value_kind(dtype: mx.Dtype) -> str:
    """A signature's kind of values: `float` for any floating dtype, else the dtype's name."""
    return "float" if mx.issubdtype(dtype, mx.floating) else str(dtype).rsplit(".", 1)[-1]


def part_of(part: Any) -> Part:
    """One index part's signature (a list of numbers indexes as the array MLX makes of it)."""
    if isinstance(part, list):
        part = mx.array(part)
    if isinstance(part, mx.array):
        return ("a", str(part.dtype).rsplit(".", 1)[-1], part.ndim)
    if isinstance(part, slice):
        return ("s",)
    if part is None:
        return ("n",)
    if part is Ellipsis:
        return ("e",)
    if isinstance(part, int):
        return ("i",)
    return ("?", type(part).__name__)


def _index(parts: tuple[Part, ...]) -> tuple[Any, ...]:
    made: list[Any] = []
    for part in parts:
        kind = part[0]
        if kind == "a":
            made.append(mx.zeros((1,) * part[2], dtype=_DTYPES[part[1]]))
        else:
            made.append({"s": slice(None), "n": None, "e": Ellipsis, "i": 0}[kind])
    return tuple(made)


def _run(sig: Signature, dtype: mx.Dtype) -> mx.array:
    op, _, rank, parts = sig
    values = mx.zeros((3,) * rank, dtype=dtype)
    index = _index(parts)
    if op == "get":
        return values[index]
    if op == "set":
        values[index] = mx.zeros((), dtype=dtype)
        return values
    name, how = op.split(":")
    axis = None if how == "flat" else 0
    (indices,) = index
    if name == "take":
        return mx.take(values, indices, axis=axis)
    if name == "take_along_axis":
        return mx.take_along_axis(values, indices, axis=axis)
    if name == "put_along_axis":
        return mx.put_along_axis(values, indices, mx.zeros(indices.shape, dtype), axis=axis)
    raise ValueError(f"unknown indexing operation {op!r}")


def warm_model_kernels(*models: nn.Module) -> list[str]:
    """`warm_index_kernels` for models served together: floats in their parameters' dtypes
    and float32, each signature run once."""
    floats = {mx.float32}
    for model in models:
        params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
        floats |= {v.dtype for _, v in params if mx.issubdtype(v.dtype, mx.floating)}
    return warm_index_kernels(sorted(floats, key=str))


def warm_index_kernels(
    floats: Sequence[mx.Dtype], signatures: Iterable[Signature] = SERVED
) -> list[str]:
    """Run each signature (floats in each of `floats`); returns those that failed, described
    (none should: the load logs them and goes on)."""
    failed: list[str] = []
    for sig in signatures:
        kinds = floats if sig[1] == "float" else [_DTYPES[sig[1]]]
        for dtype in kinds:
            try:
                mx.eval(_run(sig, dtype))
            except Exception as e:  # a signature MLX refuses must not stop the load
                failed.append(f"{sig} as {dtype}: {e}")
    for line in failed:
        log.warning("warming an indexing kernel failed: %s", line)
    return failed
