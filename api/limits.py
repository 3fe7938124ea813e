"""Request limits shared with the daemon's settings; imports nothing, so reading settings
never imports MLX before `configure_backend` has put the CPU BLAS under it."""

from __future__ import annotations

DEFAULT_MAX_BODY = 32 * 2**20  # bytes: a long context's prompt, with room to spare
