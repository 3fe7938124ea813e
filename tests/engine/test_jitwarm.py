"""The load's indexing warm-up covers every gather and scatter serving asks MLX for."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd.engine.backend import Backend, configure_backend
from mlxd.engine.grammar import GrammarSpec
from mlxd.engine.jitwarm import SERVED, Signature, warm_index_kernels, warm_model_kernels
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.registry.schema import ModelEntry
from tests.engine.test_rows import FLAT, PROMPTS, serve
from tests.fixtures.indexops import record_index_ops
from tests.fixtures.tiny_models import TinyPair


def missing(seen: set[Signature]) -> list[Signature]:
    return sorted(seen - set(SERVED))


def ptx_dir(env: dict[str, str]) -> str:
    code = (
        "import os; from mlxd.engine.backend import configure_backend as c; c(); "
        "print(os.environ['MLX_PTX_CACHE_DIR'])"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_served_rows_ask_only_for_warmed_indexing_kernels(
    tiny_pair: TinyPair, gpu_layout: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows on the GPU's layout, drafting with a model and by lookup and plainly, greedy and
    sampled with every sampler option, log-probabilities, stop strings, grammars (regex, JSON,
    Lark) beside a free row, joining mid-stream, cold and warm in the prefix cache: each
    indexing call's signature is one load runs."""
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, gpu_layout, costs=FLAT)
    prefix = PrefixCache(64 * 2**20)
    ops = record_index_ops(monkeypatch)
    variants = [
        {"temperature": 0, "draft_method": "model"},
        {"temperature": 0, "draft_method": "lookup"},
        {"temperature": 0.7, "seed": 1, "draft_method": "model"},
        {"temperature": 0.9, "seed": 2, "draft_method": "lookup", "top_k": 5, "top_p": 0.8},
        {"temperature": 0.8, "seed": 3, "draft_method": "off", "min_p": 0.1,
         "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"temperature": 0, "draft_method": "auto", "stop": ["@@"]},
    ]  # fmt: skip
    specs = [
        (PROMPTS[i], parse_options({**v, "num_predict": 12 + 3 * i}))
        for i, v in enumerate(variants)
    ]
    specs[5] = (specs[5][0], replace(specs[5][1], top_logprobs=3))
    lookups = [
        (PROMPTS[i], parse_options({"temperature": t, "seed": i, "draft_method": "lookup",
                                    "num_predict": 20}))
        for i, t in ((0, 0), (1, 0.7), (4, 0), (5, 1.0))
    ]  # fmt: skip
    constrained = [(PROMPTS[i], parse_options({"temperature": t, "seed": i, "num_predict": 16}))
                   for i, t in ((2, 0), (3, 0.8), (4, 0))]  # fmt: skip
    grammars = [
        GrammarSpec("regex", r"(yes|no)-[0-9]{3}"),
        GrammarSpec("json"),
        GrammarSpec("lark", 'start: "a" ("b" | "c")+'),
    ]
    with ops.recording():
        for _ in range(2):  # cold, then hits in the prefix cache
            serve(pairing, specs, start_after={4: (0, 3), 5: (1, 5)}, prefix=prefix)
            serve(pairing, lookups, start_after={3: (0, 4)}, prefix=prefix)
            serve(pairing, [*constrained, specs[0]], grammars=[*grammars, None], prefix=prefix)
    assert ops.seen, "the recorder saw nothing"
    gap = missing(ops.seen)
    assert not gap, f"jitwarm.SERVED lacks {gap}"


def test_every_warmed_signature_runs(tiny_pair: TinyPair) -> None:
    assert warm_index_kernels([mx.float32, mx.bfloat16]) == []
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, configure_backend(), costs=FLAT)
    assert warm_model_kernels(pairing.target, pairing.draft) == []


def test_compiled_kernels_are_kept_where_a_reboot_leaves_them(tmp_path: Path) -> None:
    """MLX's default keeps compiled kernel modules in the temporary directory; the backend
    points it at the user's cache (MLX's own layout there), unless the user chose."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    version = importlib.metadata.version("mlx")
    assert ptx_dir(env) == str(tmp_path / "mlx" / version / "ptx")
    assert ptx_dir({**env, "MLX_PTX_CACHE_DIR": str(tmp_path / "mine")}) == str(tmp_path / "mine")
