"""Rows on adapters ask MLX for no gather or scatter the load's warm-up does not run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxd.engine.backend import configure_backend
from mlxd.engine.jitwarm import SERVED
from mlxd.engine.pairing import load_pairing
from mlxd.registry.schema import ModelEntry
from tests.adapters.conftest import Adapters
from tests.adapters.test_rows import FLAT, PROMPTS, request, run
from tests.fixtures.indexops import record_index_ops
from tests.fixtures.tiny_models import TinyPair


@pytest.mark.parametrize("bucket", [None, 256], ids=["exact", "gpu-layout"])
def test_adapter_rows_ask_only_for_warmed_indexing_kernels(
    tiny_pair: TinyPair, adapters: Adapters, monkeypatch: pytest.MonkeyPatch, bucket: int | None
) -> None:
    """LoRA and DoRA rows beside base rows, alone and batched, drafting and not."""
    backend = replace(configure_backend(), kv_bucket=bucket)
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    pairing = load_pairing(entry, backend, costs=FLAT)
    ops = record_index_ops(monkeypatch)
    mix = [adapters.sql, None, adapters.tests, adapters.dora, adapters.sql]
    with ops.recording():
        run(pairing, [request(PROMPTS[0], adapters.sql, draft_method="model")])
        run(pairing, [request(PROMPTS[i % 3], a, draft_method=m)
                      for i, (a, m) in enumerate(zip(mix, ["model", "off"] * 3, strict=False))],
            num_parallel=8)  # fmt: skip
    gap = sorted(ops.seen - set(SERVED))
    assert ops.seen and not gap, f"jitwarm.SERVED lacks {gap}"
