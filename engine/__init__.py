"""How tokens are made: loading pairings, sampling, drafting, verification, detokenizing and the
per-pairing generation loop.

May import mlx, mlx-lm and `registry`; never Starlette or `api`.
"""

import os

# MLX's CUDA backend keeps its captured graphs in an LRU of 400 by default. A server's shapes
# (bucketed key lengths x prefill widths x row counts x verify widths, for two models) outgrow
# it, and an evicted graph costs a ~40 ms capture on its next use, or a "cache thrashing" abort.
# MLX reads the size once, when the first GPU stream is built; a value the user set wins.
GRAPH_CACHE_SIZE = "2048"
os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", GRAPH_CACHE_SIZE)

# Before MLX is first imported: an optimized BLAS for its CPU backend on Linux (see cpu_blas).
from mlxd.engine.cpu_blas import load_cpu_blas  # noqa: E402

load_cpu_blas()
