"""kill -9 of a real process while it writes a real model's K/V to the SSD tier, again and
again on one directory. After each kill the tier opens, holds no orphaned value file, restores
every prompt flushed before the kill, and what it restores gives the same tokens as a cold
prefill (anything damaged is refused as a miss, never restored)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine.prefix_cache import PrefixCache, build_caches, slice_layers
from tests.fault.kv import NS, PROMPT_BLOCKS, greedy, load_model, prefill, prompt
from tests.fault.ssd import referenced, value_files
from tests.fixtures.tiny_models import TinyPair

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 64


def run_writer(model: Path, directory: Path, first: int, rng: random.Random, log: Path) -> int:
    """Start the writer at prompt `first`, kill -9 it a random moment after a random number of
    flushes; the number of prompts it had flushed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fault.kv", str(model), str(directory), str(first)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        flushed = first
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready", log.read_text()
            wanted = first + 2 * rng.randint(1, 4)
            while flushed < wanted:
                line = proc.stdout.readline().strip()
                assert line and line != "finished", "writer ended early: " + log.read_text()
                flushed = int(line)
            time.sleep(rng.uniform(0, 0.05))  # mid-stream: it keeps prefilling and writing
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(60)
            if proc.stdout is not None:
                proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return flushed


def assert_close_blocks(got: list[Any], want: list[Any]) -> None:
    """Equal up to float rounding (the writer's BLAS may split a matmul differently); any
    damage that slipped past the checksum would be far larger."""
    for g_layer, w_layer in zip(got, want, strict=True):
        for g, w in zip(g_layer, w_layer, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert mx.allclose(g, w, rtol=1e-4, atol=1e-4).item()


def check_after_kill(model: Any, directory: Path, flushed: int, tried: int) -> dict[str, int]:
    cache = PrefixCache(64 << 20, directory, 1 << 30)
    try:
        assert cache.ssd is not None, cache.ssd_off
        snap = cache.snapshot()
        assert snap["ssd_damaged_db"] == ""  # SQLite's WAL survives a killed process
        assert set(value_files(directory)) == referenced(directory)  # orphans reclaimed
        restored = 0
        for i in range(tried):
            tokens = prompt(i)
            blocks = cache.lookup(NS, tokens[:-1])
            if i < flushed:
                assert len(blocks) == PROMPT_BLOCKS, f"prompt {i} was flushed but is gone"
            if not blocks:
                continue
            restored += 1
            fresh = prefill(model, tokens)
            for n, b in enumerate(blocks):
                want = slice_layers(fresh, n * BLOCK_TOKENS, (n + 1) * BLOCK_TOKENS)
                assert want is not None
                assert_close_blocks(b.arrays, want.arrays)
        # Warm equals cold, through the restored caches, for the last flushed prompt.
        tokens = prompt(flushed - 1)
        blocks = cache.lookup(NS, tokens[:-1])
        held = sum(b.tokens for b in blocks)
        warm = greedy(model, build_caches(blocks, 0, len(model.layers), None), tokens[held:])
        cold = greedy(model, prefill(model, tokens[:1]), tokens[1:])
        assert warm == cold
        return {"restored": restored, "orphans": snap["ssd_orphans_reclaimed"]}
    finally:
        cache.close()


@pytest.mark.parametrize("kills", [3, pytest.param(20, marks=pytest.mark.fault_full)])
def test_kill_9_during_ssd_writes(tiny_pair: TinyPair, tmp_path: Path, kills: int) -> None:
    rng = random.Random(kills)
    directory = tmp_path / "kvcache"
    model = load_model(tiny_pair.target)
    flushed = 0
    orphans = 0
    for n in range(kills):
        tried = flushed
        flushed = run_writer(tiny_pair.target, directory, flushed, rng, tmp_path / "writer.log")
        result = check_after_kill(model, directory, flushed, flushed + 4)
        orphans += result["orphans"]
        assert result["restored"] >= flushed > tried, n
    print(f"{kills} kills: {flushed} prompts flushed, {orphans} orphaned value files reclaimed")
