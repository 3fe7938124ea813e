"""On MLX's CPU backend: an optimized BLAS under MLX's matmuls, and 16-bit models computed in
float32 (where that BLAS serves them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import convert

from mlxd.engine import cpu_blas
from mlxd.engine.backend import CPU_DTYPE_ENV, Backend, configure_backend
from mlxd.engine.memory import computes_in_float32, estimate
from mlxd.engine.pairing import load_pairing
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import read_safetensors_header
from tests.fixtures.tiny_models import build_model

REPO = Path(__file__).resolve().parents[2]
COSTS = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.1)
LINUX = sys.platform == "linux"

# A fresh interpreter: which BLAS MLX binds is settled by what is loaded when it is imported.
PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
{first}
from mlxd.engine.backend import configure_backend
backend = configure_backend()
import numpy as np
import mlx.core as mx
a = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((512, 1280)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(w))
maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
print(json.dumps({{
    "loaded": backend.cpu_blas,
    "reason": backend.cpu_blas_reason,
    "float32": backend.float32_compute,
    "device": backend.device,
    "mkl_mapped": "libmkl_rt" in maps,
    "max_err": float(np.abs(got - a @ w).max()),
}}))
"""


def _probe(first: str, **env: str) -> tuple[dict[str, object], str]:
    """What a fresh interpreter's backend chose, and the log lines it wrote."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=REPO, env={**_base_env(), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1])), out.stderr


def _base_env() -> dict[str, str]:
    drop = (cpu_blas.ENV, "MKL_THREADING_LAYER", CPU_DTYPE_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop}


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("WARNING")]


@pytest.mark.skipif(not LINUX, reason="MLX's Linux wheel is the one with the reference BLAS")
def test_configuring_before_mlx_puts_the_optimized_blas_under_it() -> None:
    mkl = cpu_blas.mkl_library()
    if mkl is None:
        pytest.skip("the mkl package is not installed on this platform")
    got, log = _probe("")
    assert got["loaded"] == str(mkl)
    assert got["mkl_mapped"] is True
    assert isinstance(got["max_err"], float) and got["max_err"] < 1e-3  # the same product
    assert _warnings(log) == []
    said = [line for line in log.splitlines() if "backend:" in line]
    assert len(said) == 1 and said[0].startswith("INFO") and str(mkl) in said[0]


@pytest.mark.skipif(not LINUX, reason="MLX's Linux wheel is the one with the reference BLAS")
def test_off_leaves_mlx_on_its_own_blas() -> None:
    got, log = _probe("", **{cpu_blas.ENV: "off"})
    assert got["loaded"] is None and got["mkl_mapped"] is False
    assert got["float32"] is False  # the reference BLAS: 16-bit models keep their dtype
    assert isinstance(got["max_err"], float) and got["max_err"] < 1e-3
    assert "MLXD_CPU_BLAS=off" in str(got["reason"])
    assert _warnings(log) == []  # what was asked for took effect


@pytest.mark.skipif(not LINUX, reason="MLX's Linux wheel is the one with the reference BLAS")
def test_mlx_imported_first_is_left_alone_with_a_warning() -> None:
    got, log = _probe("import mlx.core", **{CPU_DTYPE_ENV: "float32"})
    assert got["loaded"] is None and got["mkl_mapped"] is False
    assert isinstance(got["max_err"], float) and got["max_err"] < 1e-3
    warned = _warnings(log)
    assert any("MLX was imported before the backend was configured" in w for w in warned)
    assert any(f"{CPU_DTYPE_ENV}=float32" in w for w in warned)  # that choice cannot apply


@pytest.mark.skipif(not LINUX, reason="loads shared libraries the Linux way")
def test_a_library_without_cblas_is_refused_with_a_warning() -> None:
    got, log = _probe("", **{cpu_blas.ENV: "libm.so.6"})
    assert got["loaded"] is None
    assert any("has no cblas_sgemm" in w for w in _warnings(log))
    missing, log = _probe("", **{cpu_blas.ENV: "/nonexistent/libblas.so"})
    assert missing["loaded"] is None
    assert any("cannot load /nonexistent/libblas.so" in w for w in _warnings(log))


def test_an_unknown_cpu_dtype_is_warned_about_and_float32_kept() -> None:
    got, log = _probe("", **{CPU_DTYPE_ENV: "fp8"})
    assert any("neither float32 nor native" in w for w in _warnings(log))
    fast_cpu = got["device"] == "cpu" and got["loaded"] is not None
    assert got["float32"] is fast_cpu  # the default policy stands


def test_importing_mlxd_changes_nothing_in_the_process() -> None:
    """Every module of the package imported (MLX with them), in a fresh interpreter: no library
    loaded, no variable set, no function of mlx-lm replaced."""
    probe = """
import json, os, pkgutil, importlib, sys
before = dict(os.environ)
for sub in ("registry", "engine", "api", "daemon"):
    package = importlib.import_module("mlxd." + sub)
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(m.name)
from mlx_lm.models import base
maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
print(json.dumps({
    "env": sorted(k for k in os.environ if os.environ[k] != before.get(k)),
    "mkl_mapped": "libmkl_rt" in maps,
    "patched": hasattr(base.scaled_dot_product_attention, "__wrapped__"),
    "modules": len([m for m in sys.modules if m.startswith("mlxd.")]),
}))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=_base_env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["env"] == []
    assert got["mkl_mapped"] is False
    assert got["patched"] is False
    assert got["modules"] > 20  # the whole package was imported


# -- float32 compute on the CPU ---------------------------------------------------------------


def test_which_models_compute_in_float32() -> None:
    bf16 = {"torch_dtype": "bfloat16"}
    assert computes_in_float32(bf16, True)
    assert computes_in_float32({"dtype": "float16"}, True)
    assert not computes_in_float32(bf16, False)  # MLXD_CPU_DTYPE=native, a GPU, no fast BLAS
    q4 = {**bf16, "quantization": {"bits": 4}}
    assert computes_in_float32(q4, True)  # its float tensors, as 16-bit models by default
    assert computes_in_float32(q4, False, True)  # a CPU without a fast BLAS
    assert not computes_in_float32(q4, True, False)
    assert not computes_in_float32({"torch_dtype": "float32"}, True)


def test_the_backend_widens_only_on_the_cpu_over_a_fast_blas() -> None:
    backend = configure_backend()
    fast_cpu = backend.device == "cpu" and backend.cpu_blas is not None
    assert backend.float32_compute is (fast_cpu and os.environ.get(CPU_DTYPE_ENV) != "native")
    cpu = backend.device == "cpu"
    assert backend.quantized_float32 is (cpu and os.environ.get(CPU_DTYPE_ENV) != "native")
    assert (backend.kv_bucket is not None) is (backend.device == "gpu")
    assert backend.batched_attention is (backend.graph_cache_size is not None)  # both CUDA


def test_a_16_bit_model_loads_in_float32_and_is_budgeted_so(tmp_path: Path) -> None:
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    path = build_model(tmp_path, "bf16", seed=3, dtype="bfloat16", **shape)
    entry = ModelEntry("b", str(path))

    widening = Backend("cpu", None, "", True, None, False, None)
    pairing = load_pairing(entry, widening, costs=COSTS)
    assert pairing.target.model.embed_tokens.weight.dtype == mx.float32
    assert pairing.revision.endswith("+float32")  # its K/V never meet the 16-bit model's
    widened = estimate([path], entry, 2, widening.float32_compute)

    native = load_pairing(entry, replace(widening, float32_compute=False), costs=COSTS)
    assert native.target.model.embed_tokens.weight.dtype == mx.bfloat16
    assert native.revision == pairing.revision.removesuffix("+float32")
    files = estimate([path], entry, 2, False)
    assert widened.weights == files.weights + tensor_bytes(path, "BF16")  # every tensor twice
    assert widened.kv == 2 * files.kv


def tensor_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes of the tensors of `dtype` in a model's safetensors files."""
    return sum(
        info["data_offsets"][1] - info["data_offsets"][0]
        for f in model_dir.glob("*.safetensors")
        for info in read_safetensors_header(f).values()
        if info["dtype"] == dtype
    )


def test_a_quantized_model_widens_its_float_tensors_only(tmp_path: Path) -> None:
    """MLX's CPU quantized matmul is several times faster on float32 scales and inputs: a
    4-bit model's scales, biases, norms and embeddings load in float32, its packed weights
    stay, its logits stay the 16-bit ones' to rounding, and the budget counts what grew."""
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    source = build_model(tmp_path, "bf16", seed=3, dtype="bfloat16", **shape)
    path = tmp_path / "q4"
    convert(str(source), str(path), quantize=True, q_group_size=64, q_bits=4)
    entry = ModelEntry("q", str(path))
    # no fast BLAS: 16-bit models keep their dtype, quantized ones still widen
    widening = Backend("cpu", None, "", False, None, False, None, quantized_float32=True)
    pairing = load_pairing(entry, widening, costs=COSTS)
    native = load_pairing(entry, replace(widening, quantized_float32=False), costs=COSTS)
    q_proj = pairing.target.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    assert q_proj.weight.dtype == mx.uint32 and q_proj.scales.dtype == mx.float32
    assert pairing.revision == native.revision + "+float32"
    tokens = mx.array([[3, 5, 7, 11, 13]])
    wide = pairing.target.model(tokens)
    narrow = native.target.model(tokens).astype(mx.float32)
    assert wide.dtype == mx.float32
    assert mx.allclose(wide, narrow, atol=0.05 * mx.abs(narrow).max().item()).item()

    widened = estimate([path], entry, 2, False, True)
    files = estimate([path], entry, 2, False, False)
    assert widened.weights == files.weights + tensor_bytes(path, "BF16")
    assert files.weights < widened.weights < 2 * files.weights  # the packed weights stay
    assert widened.kv == 2 * files.kv
