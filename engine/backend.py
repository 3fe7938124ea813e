"""What the daemon decides about the machine, decided once, at startup.

`configure_backend` is the only place that changes the process for MLX: it puts an optimized
BLAS under MLX's CPU backend (which must happen before `mlx.core` is imported), turns off MLX's
CUDA graphs and sizes their cache (both read at the first GPU work) and routes batched
decoding's attention to mlxd's kernel on CUDA. It returns a frozen `Backend` that the daemon
hands down to whatever needs its choices; importing any mlxd module changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from mlxd.engine import cpu_blas

log = logging.getLogger(__name__)

CPU_DTYPE_ENV = "MLXD_CPU_DTYPE"  # "float32" (default) or "native"
GRAPH_CACHE_ENV = "MLX_CUDA_GRAPH_CACHE_SIZE"
# MLX's CUDA backend keeps its captured graphs in an LRU of 400 by default. A server's shapes
# (bucketed key lengths x prefill widths x row counts x verify widths, for two models) outgrow
# it, and an evicted graph costs a ~40 ms capture on its next use, or a "cache thrashing" abort.
GRAPH_CACHE_SIZE = 2048
SDPA_CACHE_ENV = "MLX_CUDA_SDPA_CACHE_SIZE"
# MLX's CUDA attention keeps the cuDNN graph it builds per shape (a multi-token forward at a
# new key length paid 38-52 ms on the code pair) in a per-thread LRU of 256. Warm-up alone runs
# 100-200 shapes on the serving thread (a pairing, 8 rows, an 8k context: 115 multi-token
# ones), and every longer context a request brings adds more: evicted, a warmed shape is built
# again inside someone's round.
SDPA_CACHE_SIZE = 4096
PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"
# MLX's CUDA build compiles a kernel module with NVRTC the first time a process meets a gather,
# scatter or fused operation of a new kind (3-20 s each on an H100 host) and keeps it on disk,
# by default under the temporary directory, which a reboot empties: the next start would
# compile them all again (a cold start's probe took 110 s, most of it compiling). mlxd keeps
# them in the user's cache directory instead (`~/.cache/mlx/<version>/ptx`, MLX's own layout),
# shared by every daemon and home on the machine: compiled once per machine and MLX version.
GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"
FUSE_MLP_ENV = "MLXD_FUSE_MLP"  # "1": an MLP's gate and up projections as one matmul (GPU)
# "0": a lone row's few-token forwards keep cuBLAS (CUDA); "batches": a batch's take the kernel too
FEW_ROWS_ENV = "MLXD_FEW_ROWS"
# MLX's CUDA backend records each evaluation's kernels into CUDA graphs and replays them. On an
# H200 serving a 7-8B bf16 model (`bench/concurrency.py`, `bench/adapters.py`), launching the
# kernels directly instead served 8 clients at 624 tok/s against 305-408 with graphs, and a
# lone row on LoRA adapters at 0.89x the base's speed against 0.48x: a decode step's host time
# is its launches', and a batch's steps (rows joining and leaving, verify widths) keep
# changing the graph's shape.


@dataclass(frozen=True)
class Backend:
    """The machine-wide choices, as they took effect."""

    device: str  # "gpu" (Metal or CUDA) or "cpu": the `mlxd ps` PROCESSOR column
    cpu_blas: str | None  # the library serving MLX's CPU matmuls, None: MLX's own
    cpu_blas_reason: str  # why that library (or none)
    float32_compute: bool  # 16-bit models compute in float32 (the CPU on a fast BLAS)
    kv_bucket: int | None  # keys per bucket of the KV caches; None: mlx-lm's exact caches
    batched_attention: bool  # batched decoding reads each row's own keys (CUDA kernel)
    graph_cache_size: int | None  # MLX's CUDA graph cache; None: not CUDA
    cuda_graphs: bool | None = None  # whether MLX records CUDA graphs; None: not CUDA
    fused_mlp: bool = False  # an MLP's gate and up projections are one matmul (GPU, opt-in)
    few_rows: bool = False  # a lone row's few-token forwards take mlxd's kernel (CUDA)
    few_rows_batches: bool = False  # a batch's too (opt-in)
    # quantized models' float tensors compute in float32 (the CPU, with or without a fast
    # BLAS: MLX's CPU quantized matmul is several times faster on float32 scales and inputs)
    quantized_float32: bool = False

    def describe(self) -> str:
        """One line for the startup log."""
        blas = self.cpu_blas or f"MLX's own ({self.cpu_blas_reason})"
        kv = f"bucketed by {self.kv_bucket}" if self.kv_bucket else "exact"
        graphs = ""
        if self.cuda_graphs is not None:
            graphs = f", CUDA graphs {'on' if self.cuda_graphs else 'off'}"
        if self.cuda_graphs and self.graph_cache_size is not None:
            graphs += f" (cache {self.graph_cache_size})"
        return (
            f"backend: {self.device}, CPU BLAS {blas},"
            f" compute {self._compute()},"
            f" KV caches {kv},"
            f" batched attention {'per-row kernel' if self.batched_attention else 'masked'}"
            f"{', gate and up fused' if self.fused_mlp else ''}"
            f"{', few-token projections on mlxd kernel' if self.few_rows else ''}"
            f"{' (batches too)' if self.few_rows_batches else ''}{graphs}"
        )

    def _compute(self) -> str:
        if self.float32_compute:
            return "float32"
        if self.quantized_float32:
            return "float32 for quantized models, native dtype for others"
        return "native dtype"


def _cpu_dtype(env: Mapping[str, str]) -> tuple[str, bool]:
    """("float32" or "native", whether the user set it)."""
    raw = env.get(CPU_DTYPE_ENV, "").strip().lower()
    if raw in ("float32", "native"):
        return raw, True
    if raw:
        log.warning("%s=%r is neither float32 nor native; using float32", CPU_DTYPE_ENV, raw)
    return "float32", False


def _cache_size(env: MutableMapping[str, str], name: str, size: int) -> int | None:
    """Size one of MLX's caches unless the user did: the size in effect (None if unreadable)."""
    env.setdefault(name, str(size))
    try:
        return int(env[name])
    except ValueError:
        log.warning("%s=%r is not a number; MLX ignores it", name, env[name])
        return None


def kernel_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where MLX keeps its compiled kernel modules unless `MLX_PTX_CACHE_DIR` says."""
    root = Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return root / "mlx" / version / "ptx"


def _cuda_graphs(env: MutableMapping[str, str]) -> bool:
    """Turn MLX's CUDA graphs off unless the user chose: whether they stay on."""
    env.setdefault(GRAPHS_ENV, "0")
    return env[GRAPHS_ENV].strip().lower() not in ("0", "false", "off", "no")


_configured: Backend | None = None  # the choices are the process's: made once


def configure_backend(env: MutableMapping[str, str] = os.environ) -> Backend:
    """Make the machine-wide choices and return them; call once, before anything imports MLX
    (`mlxd serve` does it first thing). Choices that cannot take effect are logged as warnings
    saying why. A library loaded and a route installed stay for the life of the process, so a
    second call returns the first one's choices."""
    global _configured
    if _configured is not None:
        return _configured
    mlx_first = "mlx.core" in sys.modules
    blas = cpu_blas.load_cpu_blas(env, env)
    if blas.refused:
        log.warning("%s: %s", cpu_blas.ENV, blas.reason)
    graph_cache = _cache_size(env, GRAPH_CACHE_ENV, GRAPH_CACHE_SIZE)  # before MLX's GPU work
    _cache_size(env, SDPA_CACHE_ENV, SDPA_CACHE_SIZE)  # read at the first attention
    graphs = _cuda_graphs(env)  # read at MLX's first GPU work
    env.setdefault(PTX_CACHE_ENV, str(kernel_cache_dir(env)))  # read at MLX's first compile

    import mlx.core as mx  # after the BLAS: MLX binds what is in the global scope now

    from mlxd.engine.attention import cuda_available, install_batched_decode
    from mlxd.engine.kvcache import GPU_BUCKET

    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    cuda = on_gpu and cuda_available()
    if cuda and mlx_first:
        log.warning(
            "MLX was imported before the backend was configured: %s=%s and %s=%s take effect"
            " only if it did no GPU work yet",
            GRAPH_CACHE_ENV,
            graph_cache,
            GRAPHS_ENV,
            env[GRAPHS_ENV],
        )
    # MLX's CPU backend has no fast 16-bit matmul (3-7 GFLOP/s against 15-165 for float32 on
    # the optimized BLAS), so there 16-bit models compute in float32, at twice the weights'
    # memory. On the reference BLAS float32 would speed one stream but slow batches of rows.
    dtype, dtype_set = _cpu_dtype(env)
    widen = not on_gpu and dtype == "float32" and blas.path is not None
    if dtype_set and dtype == "float32" and not on_gpu and not widen:
        log.warning(
            "%s=float32: 16-bit models keep their files' dtype, quantized ones alone compute"
            " in float32 (no optimized BLAS under MLX: %s)",
            CPU_DTYPE_ENV,
            blas.reason,
        )
    few_rows = env.get(FEW_ROWS_ENV, "1").strip().lower()
    backend = Backend(
        device="gpu" if on_gpu else "cpu",
        cpu_blas=blas.path,
        cpu_blas_reason=blas.reason,
        float32_compute=widen,
        kv_bucket=GPU_BUCKET if on_gpu else None,
        batched_attention=cuda,
        graph_cache_size=graph_cache if cuda else None,
        cuda_graphs=graphs if cuda else None,
        fused_mlp=on_gpu and env.get(FUSE_MLP_ENV, "0").strip().lower() in ("1", "true", "on"),
        few_rows=cuda and few_rows not in ("0", "false", "off"),
        few_rows_batches=cuda and few_rows == "batches",
        quantized_float32=not on_gpu and dtype == "float32",
    )
    if cuda:
        install_batched_decode()  # batch rows attend to their own keys, no mask
    log.info("%s", backend.describe())
    _configured = backend
    return backend
