"""Model pairings that ship inside the repository, so mlxd works offline.

Each pairing is a folder with ``target/`` and ``draft/`` checkpoints in Hugging
Face layout (loadable by ``mlx_lm.load``) that share one tokenizer. They are
built by ``python -m tools.embedded_train``; see ``tiny/TRAINING.md``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EMBEDDED_DIR", "TINY_DIR"]

EMBEDDED_DIR: Path = Path(__file__).resolve().parent
TINY_DIR: Path = EMBEDDED_DIR / "tiny"
