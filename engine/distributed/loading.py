"""Opening a distributed target: the ranks hold the weights, the daemon the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.utils import load_config, load_tokenizer

from mlxd.engine.backend import Backend
from mlxd.engine.distributed.group import GroupError
from mlxd.engine.distributed.target import DistributedTarget
from mlxd.engine.memory import computes_in_float32
from mlxd.registry.distributed import Distribution


def load_distributed(
    name: str, path: Path, dist: Distribution, backend: Backend, template: str | None
) -> tuple[DistributedTarget, Any, dict[str, Any]]:
    """The sharded target (its ranks started), its tokenizer and config. Every rank reads the
    weights from `path`, so the files must be at that path on every host. GroupError (a
    ValueError's sibling: a RuntimeError) when the ranks do not start, saying why."""
    config = load_config(path)
    extra = {"chat_template": template} if template else None
    tokenizer = load_tokenizer(path, extra, eos_token_ids=config.get("eos_token_id"))
    float32 = computes_in_float32(config, backend.float32_compute, backend.quantized_float32)
    target = DistributedTarget(name, path, dist, float32)
    return target, tokenizer, config


__all__ = ["GroupError", "load_distributed"]
