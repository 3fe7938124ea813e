"""Memory a pairing needs before it is loaded, and how much the daemon may use in all.

A pairing's need is estimated from its files alone, so a load that cannot fit is refused (or
makes room) before anything is allocated: the weights' bytes on disk, the KV cache for the
context every parallel row may fill, and a fixed allowance for activations and buffers.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from mlxd.engine.context import row_context
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import ModelFilesError, model_files, read_safetensors_header

OVERHEAD_BYTES = 128 * 1024 * 1024  # activations, logits, compute buffers per pairing
BUDGET_FRACTION = 0.75  # of total memory, when MLXD_MEMORY_BUDGET is not set
DEFAULT_KV_DTYPE_BYTES = 2

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


# -- sizes -----------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Ollama's `format.HumanBytes2`: `4.2 GiB`, `512.0 MiB`, `900 B`."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# -- what one pairing needs --------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a pairing will hold once loaded (target and draft together)."""

    weights: int
    kv: int
    overhead: int
    context: int  # KV tokens per row
    rows: int  # parallel sequences

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.overhead


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        with open(model_dir / "config.json", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the safetensors files: what the weights take once loaded."""
    return sum(f.stat().st_size for f in model_files(model_dir) if f.suffix == ".safetensors")


def _first_int(config: Mapping[str, Any], *keys: str) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in keys:
            value = scope.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _dtype_bytes(config: Mapping[str, Any]) -> int:
    for scope in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            size = _DTYPE_BYTES.get(str(scope.get(key, "")).lower())
            if size:
                return size
    return DEFAULT_KV_DTYPE_BYTES


def computes_in_float32(
    config: Mapping[str, Any], widen: bool, widen_quantized: bool | None = None
) -> bool:
    """Whether a model computes in float32 rather than its files' 16-bit floats: a 16-bit
    model where the backend widens them (`widen`: `Backend.float32_compute`), a quantized one
    where it widens those (`widen_quantized`, default `widen`: `Backend.quantized_float32`).
    A quantized model widens its float tensors (scales, biases, norms, embeddings) and keeps
    its packed weights: MLX's CPU quantized matmul multiplied a 7B-shaped 4-bit MLP projection
    in 58 ms with float32 scales and inputs against 468 ms with bf16 ones, and the code pair's
    target quantized to 4 bits decoded a token in 24-27 ms against 184, with or without a fast
    BLAS."""
    if _dtype_bytes(config) != 2:
        return False
    if config.get("quantization") or config.get("quantization_config"):
        return widen if widen_quantized is None else widen_quantized
    return widen


def computed_weight_bytes(
    model_dir: Path, config: Mapping[str, Any], widen: bool, widen_quantized: bool | None = None
) -> int:
    """Bytes the weights take once loaded: the files' bytes, plus the 16-bit float tensors'
    bytes once more where they are widened to float32 (every tensor of a 16-bit model; a
    quantized one's scales, biases, norms and embeddings). Headers that cannot be read count
    the whole files twice."""
    on_disk = weight_bytes(model_dir)
    if not computes_in_float32(config, widen, widen_quantized):
        return on_disk
    extra = 0
    for f in model_files(model_dir):
        if f.suffix != ".safetensors":
            continue
        try:
            header = read_safetensors_header(f)
        except (ModelFilesError, OSError):
            return 2 * on_disk
        for info in header.values():
            if info.get("dtype") in ("BF16", "F16"):
                start, end = info["data_offsets"]
                extra += end - start
    return on_disk + extra


def as_computed(
    config: Mapping[str, Any], widen: bool, widen_quantized: bool | None = None
) -> dict[str, Any]:
    """`config` with the dtype the model computes (and caches K/V) in."""
    if not computes_in_float32(config, widen, widen_quantized):
        return dict(config)
    return {**config, "torch_dtype": "float32", "dtype": "float32"}


def kv_element_bytes(config: Mapping[str, Any], options: Mapping[str, Any]) -> float:
    """Bytes per cached element: the model's dtype, or `kv_bits` plus a scale and bias per
    group when the entry quantizes its KV cache."""
    dtype = _dtype_bytes(config)
    bits = options.get("kv_bits")
    if bits not in (4, 8):
        return float(dtype)
    group = options.get("kv_group_size", 64)
    group = group if isinstance(group, int) and group > 0 else 64
    return bits / 8 + 2 * dtype / group


def head_dim(config: Mapping[str, Any]) -> int:
    heads = _first_int(config, "num_attention_heads", "n_head", "num_heads") or 1
    explicit = _first_int(config, "head_dim")
    if explicit is not None:
        return explicit
    return (_first_int(config, "hidden_size", "n_embd", "d_model") or 0) // heads


def kv_bytes_per_token(config: Mapping[str, Any], options: Mapping[str, Any] | None = None) -> int:
    """2 (keys and values) × layers × KV heads × head dim × bytes per element."""
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers") or 0
    heads = _first_int(config, "num_attention_heads", "n_head", "num_heads") or 1
    kv_heads = _first_int(config, "num_key_value_heads", "n_head_kv", "num_kv_heads") or heads
    element = kv_element_bytes(config, options or {})
    return int(2 * layers * kv_heads * head_dim(config) * element)


def estimate(
    dirs: list[Path],
    entry: ModelEntry,
    rows: int,
    widen: bool,
    widen_quantized: bool | None = None,
) -> MemoryNeed:
    """The need of a pairing whose files are in `dirs` (target first, then the draft); `widen`
    and `widen_quantized`: which models compute in float32 (`computes_in_float32`). Each row
    reserves the pairing's context (`context.row_context`)."""
    files = [_read_config(d) for d in dirs]
    configs = [as_computed(c, widen, widen_quantized) for c in files]
    context = row_context(entry, configs[0])
    rows = max(1, rows)
    kv = sum(kv_bytes_per_token(c, entry.options) for c in configs) * context * rows
    weights = [
        computed_weight_bytes(d, f, widen, widen_quantized)
        for d, f in zip(dirs, files, strict=True)
    ]
    return MemoryNeed(
        weights=sum(weights),
        kv=kv,
        overhead=OVERHEAD_BYTES,
        context=context,
        rows=rows,
    )


def estimate_embedding(
    model_dir: Path, max_length: int, widen: bool, widen_quantized: bool | None = None
) -> MemoryNeed:
    """An embedding model's need: its weights (widened where it computes in float32) and the
    fixed allowance; it keeps no cache between requests."""
    config = _read_config(model_dir)
    return MemoryNeed(
        weights=computed_weight_bytes(model_dir, config, widen, widen_quantized),
        kv=0,
        overhead=OVERHEAD_BYTES,
        context=max_length,
        rows=1,
    )


# -- what the daemon may use -------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # "MLXD_MEMORY_BUDGET" or "75% of 32.0 GiB"


def _device_memory() -> int:
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:
        return 0
    for key in ("memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        return cast(Callable[[int], int], libc.malloc_trim)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator gives back
        return None


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system once a model is gone (glibc's
    `malloc_trim`): its weights, freed, otherwise stay in the arenas of the threads that held
    them, and an idle daemon's resident memory grew by about a model's size per load and
    unload (1.5 GB after 20 cycles of a 121 MB model; 193 MB once trimmed)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def arrays_bytes() -> int:
    """What MLX's arrays hold now (weights, adapters, K/V, the RAM cache tier): the memory a
    server's work takes, where a process's RSS also counts runtimes and compiled kernels."""
    import mlx.core as mx

    return int(mx.get_active_memory())


def total_memory() -> int:
    """The device's memory (unified memory on Metal), else the machine's physical memory."""
    return _device_memory() or _physical_memory()


def resolve_budget(configured: int | None) -> Budget:
    if configured is not None and configured > 0:
        return Budget(configured, "MLXD_MEMORY_BUDGET")
    total = total_memory()
    if total <= 0:
        return Budget(2**63 - 1, "unknown total memory: unlimited")
    return Budget(int(total * BUDGET_FRACTION), f"{BUDGET_FRACTION:.0%} of {human_bytes(total)}")
