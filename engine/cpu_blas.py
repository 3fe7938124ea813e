"""An optimized BLAS under MLX's CPU backend on Linux.

MLX's Linux CPU wheel links the reference BLAS: a float32 matmul runs at about 4 GFLOP/s, and a
batch of 8 rows costs 8 times one row. MLX's library looks `cblas_sgemm` (and LAPACK) up in the
global symbol scope first, so a BLAS loaded there before `mlx.core` is imported serves all of
MLX's float32 matmuls. mlxd loads Intel's MKL from its pip package (the `mkl` extra on Linux
x86-64: about 1 GB installed, so it is a choice, not a default dependency) this way; `MLXD_CPU_BLAS` picks another library (a path to one exporting `cblas_sgemm`, such as
a distribution's libopenblas) or `off`.

This module must not import MLX: the backend configuration calls `load_cpu_blas` before
anything does. Nothing happens on import.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

ENV = "MLXD_CPU_BLAS"  # "auto" (default), "off", or a path to a shared library


@dataclass(frozen=True)
class BlasChoice:
    """The library serving MLX's CPU matmuls (None: MLX's own), why, and whether what the user
    asked for could not take effect (then `reason` says why, for a warning)."""

    path: str | None
    reason: str
    refused: bool = False


# A library loaded into the global symbol scope stays there for the life of the process.
_loaded: str | None = None


def mkl_library() -> Path | None:
    """MKL's single dynamic library, where the `mkl` package put it (None: not installed)."""
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(f.locate()).resolve()
            if path.is_file():
                return path
    return None


def load_cpu_blas(
    env: Mapping[str, str] = os.environ, process_env: MutableMapping[str, str] = os.environ
) -> BlasChoice:
    """Put an optimized BLAS in the global symbol scope, once, before MLX is imported.
    `process_env` receives MKL's threading layer (what the library reads when it loads)."""
    global _loaded
    if _loaded is not None:
        return BlasChoice(_loaded, "loaded")
    choice = env.get(ENV, "auto").strip() or "auto"
    if sys.platform != "linux":
        return BlasChoice(None, "not Linux: MLX's own BLAS serves")
    if choice == "off":
        return BlasChoice(None, f"{ENV}=off")
    if "mlx.core" in sys.modules:
        return BlasChoice(
            None,
            "MLX was imported before the backend was configured, so no BLAS can be put under"
            " it; its CPU matmuls keep the reference BLAS",
            refused=True,
        )
    path = mkl_library() if choice == "auto" else Path(choice)
    if path is None:
        return BlasChoice(
            None,
            "the mkl package is not installed (pip install 'mlxd[mkl]' for faster CPU matmuls,"
            " or set MLXD_CPU_BLAS to a library exporting cblas_sgemm)",
        )
    # MKL threads through OpenMP by default, which spins on cores the server's other threads
    # need; decoding's few-row matmuls run as fast on one thread. A value the user set wins.
    process_env.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return BlasChoice(None, f"cannot load {path} ({exc}); MLX keeps its reference BLAS", True)
    if not hasattr(lib, "cblas_sgemm"):
        return BlasChoice(None, f"{path} has no cblas_sgemm; MLX keeps its reference BLAS", True)
    _loaded = str(path)
    return BlasChoice(_loaded, "loaded")
