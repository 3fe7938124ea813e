"""An optimized BLAS under MLX's CPU backend on Linux.

MLX's Linux CPU wheel links the reference BLAS: a float32 matmul runs at about 4 GFLOP/s, and a
batch of 8 rows costs 8 times one row. MLX's library looks `cblas_sgemm` (and LAPACK) up in the
global symbol scope first, so a BLAS loaded there before `mlx.core` is imported serves all of
MLX's float32 matmuls. mlxd loads Intel's MKL from its pip package (a dependency on Linux x86-64)
this way; `MLXD_CPU_BLAS` picks another library (a path to one exporting `cblas_sgemm`, such as
a distribution's libopenblas) or `off`.

This module must not import MLX: `engine/__init__.py` calls `load_cpu_blas` before anything does.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "MLXD_CPU_BLAS"  # "auto" (default), "off", or a path to a shared library

loaded: str | None = None  # the library serving MLX's CPU matmuls in this process, if any


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


def load_cpu_blas(env: Mapping[str, str] = os.environ) -> str | None:
    """Put an optimized BLAS in the global symbol scope, once, before MLX is imported; returns
    its path, or None where nothing was loaded (not Linux, `off`, none found, MLX already in)."""
    global loaded
    if loaded is not None:
        return loaded
    choice = env.get(ENV, "auto").strip() or "auto"
    if sys.platform != "linux" or choice == "off":
        return None
    if "mlx.core" in sys.modules:
        log.debug("%s: MLX was imported first; its CPU matmuls keep the reference BLAS", ENV)
        return None
    path = mkl_library() if choice == "auto" else Path(choice)
    if path is None:
        return None
    # MKL threads through OpenMP by default, which spins on cores the server's other threads
    # need; decoding's few-row matmuls run as fast on one thread. A value the user set wins.
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        log.warning("%s: cannot load %s (%s); MLX keeps its reference BLAS", ENV, path, exc)
        return None
    if not hasattr(lib, "cblas_sgemm"):
        log.warning("%s: %s has no cblas_sgemm; MLX keeps its reference BLAS", ENV, path)
        return None
    loaded = str(path)
    return loaded
