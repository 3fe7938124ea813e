"""Limits the daemon's configuration reads before anything imports MLX (`mlxd serve` puts the
CPU BLAS under MLX first), so this module imports nothing of the engine."""

from __future__ import annotations

DEFAULT_MAX_BODY = 32 * 2**20  # bytes: a long context's prompt, with room to spare
