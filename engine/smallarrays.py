"""Small arrays that kernels read every layer, kept out of MLX's CUDA scalar pool.

MLX's CUDA allocator hands out arrays of 8 bytes or less from one pool of read-mostly managed
memory, and kernels reading one there ran slowly on an H200: with a lone adapted row's 4-byte
slot index read by its two kernels per group of projections, 16 7B-shaped blocks took 1.64x the
base's step; with the index a view of a 16-byte array, 1.15x (`bench/lora_kernels.py`). Views
of a larger array keep its buffer, so they are never placed in the pool; elsewhere the few
bytes of padding cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

__all__ = ["MIN_BYTES", "kernel_array"]

MIN_BYTES = 16  # the pool takes arrays of 8 bytes or less


def kernel_array(values: Sequence[int] | Sequence[float], dtype: mx.Dtype) -> mx.array:
    """mx.array(values, dtype) (1-D), backed by at least MIN_BYTES."""
    count = len(values)
    room = -(-MIN_BYTES // dtype.size)
    if count >= room:
        return mx.array(list(values), dtype=dtype)
    return mx.array([*values, *([0] * (room - count))], dtype=dtype)[:count]
