"""On MLX's CPU backend: an optimized BLAS under MLX's matmuls, and 16-bit models computed in
float32 (where that BLAS serves them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd.engine import cpu_blas
from mlxd.engine.memory import CPU_DTYPE_ENV, computes_in_float32, estimate
from mlxd.engine.pairing import load_pairing
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import build_model

REPO = Path(__file__).resolve().parents[2]
COSTS = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.1)
ON_CPU = mx.default_device() == mx.cpu
FAST_CPU = ON_CPU and cpu_blas.loaded is not None  # float32 compute needs the optimized BLAS
LINUX = sys.platform == "linux"

# A fresh interpreter: which BLAS MLX binds is settled by what is loaded when it is imported.
PROBE = """
import json, sys
{first}
import numpy as np
import mlx.core as mx
from mlxd.engine import cpu_blas
a = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((512, 1280)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(w))
maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
print(json.dumps({{
    "loaded": cpu_blas.loaded,
    "mkl_mapped": "libmkl_rt" in maps,
    "max_err": float(np.abs(got - a @ w).max()),
}}))
"""


def _probe(first: str, **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=REPO, env={**_base_env(), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (cpu_blas.ENV, "MKL_THREADING_LAYER")}


@pytest.mark.skipif(not LINUX, reason="MLX's Linux wheel is the one with the reference BLAS")
def test_importing_the_engine_first_puts_the_optimized_blas_under_mlx() -> None:
    got = _probe("import engine")
    mkl = cpu_blas.mkl_library()
    if mkl is None:
        pytest.skip("the mkl package is not installed on this platform")
    assert got["loaded"] == str(mkl)
    assert got["mkl_mapped"] is True
    assert isinstance(got["max_err"], float) and got["max_err"] < 1e-3  # the same product


@pytest.mark.skipif(not LINUX, reason="MLX's Linux wheel is the one with the reference BLAS")
def test_off_and_a_late_import_leave_mlx_on_its_own_blas() -> None:
    off = _probe("import engine", **{cpu_blas.ENV: "off"})
    late = _probe("import mlx.core\nimport engine")
    for got in (off, late):
        assert got["loaded"] is None
        assert got["mkl_mapped"] is False
        assert isinstance(got["max_err"], float) and got["max_err"] < 1e-3


@pytest.mark.skipif(not LINUX, reason="loads shared libraries the Linux way")
def test_a_library_without_cblas_is_refused() -> None:
    got = _probe("import engine", **{cpu_blas.ENV: "libm.so.6"})
    assert got["loaded"] is None
    missing = _probe("import engine", **{cpu_blas.ENV: "/nonexistent/libblas.so"})
    assert missing["loaded"] is None


# -- float32 compute on the CPU ---------------------------------------------------------------


def test_which_models_compute_in_float32() -> None:
    bf16 = {"torch_dtype": "bfloat16"}
    assert computes_in_float32(bf16, {}) is FAST_CPU
    assert computes_in_float32({"dtype": "float16"}, {}) is FAST_CPU
    assert not computes_in_float32(bf16, {CPU_DTYPE_ENV: "native"})
    assert not computes_in_float32({**bf16, "quantization": {"bits": 4}}, {})
    assert not computes_in_float32({"torch_dtype": "float32"}, {})


@pytest.mark.skipif(not FAST_CPU, reason="float32 compute is for the CPU backend on a fast BLAS")
def test_a_16_bit_model_loads_in_float32_and_is_budgeted_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    path = build_model(tmp_path, "bf16", seed=3, dtype="bfloat16", **shape)
    entry = ModelEntry("b", str(path))

    pairing = load_pairing(entry, costs=COSTS)
    assert pairing.target.model.embed_tokens.weight.dtype == mx.float32
    assert pairing.revision.endswith("+float32")  # its K/V never meet the 16-bit model's
    widened = estimate([path], entry, rows=2)

    monkeypatch.setenv(CPU_DTYPE_ENV, "native")
    native = load_pairing(entry, costs=COSTS)
    assert native.target.model.embed_tokens.weight.dtype == mx.bfloat16
    assert native.revision == pairing.revision.removesuffix("+float32")
    files = estimate([path], entry, rows=2)
    assert widened.weights == 2 * files.weights
    assert widened.kv == 2 * files.kv
