"""Single-token attention for batch rows of different lengths, without a mask.

A batch cache left-pads its rows to one write position, so batched decoding needs a mask. On
MLX's CUDA build an attention with an array mask leaves the fused decode kernel for an unfused
matmul + softmax over the whole key buffer (1024 keys and up with the bucketed batch cache),
and at 8 rows of an 8B model that was a third of each step. Here each row's query reads exactly
its own keys, [left padding, write position), in one kernel launch per layer.

`install_batched_decode` (called once by the backend configuration, on CUDA) sends every model's
single-token attention over a `BucketedBatchKVCache` to that kernel. A multi-token attention
over a bucketed cache (a verify round, a draft catch-up) at a shape the serving thread's warm-up
did not run takes MLX's plain operations: MLX's own would build a cuDNN graph for the shape
first, inside the round. Every other call (prefill, solo decoding, other caches, shapes warmed)
keeps mlx-lm's path, with a boolean mask made additive once per forward (MLX converts it in
every layer's call).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from mlxd.engine.kvcache import BucketedBatchKVCache, BucketedKVCache
from mlxd.engine.sampling import to_ints
from mlxd.engine.smallarrays import kernel_array
from mlxd.engine.threads import reset_after_work

Ragged = Callable[[mx.array, mx.array, mx.array, float, mx.array, int | mx.array], mx.array]

WARPS = 16  # warps per (row, head) block; each walks every WARPS-th key

_SOURCE = """
    const int bh = blockIdx.x;
    const int heads = q_shape[1];
    const int kv_heads = k_shape[1];
    const int capacity = k_shape[2];
    const int b = bh / heads;
    const int kv = (bh % heads) / (heads / kv_heads);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    constexpr int PER = D / 32;
    const float sc = scale[0];
    const float lowest = __int_as_float(0xff800000);  // -inf

    float qv[PER];
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(q[(size_t)bh * D + lane * PER + i]) * sc;
    }
    const size_t base = ((size_t)b * kv_heads + kv) * capacity * D;
    float m = lowest, s = 0.0f, o[PER];
    for (int i = 0; i < PER; ++i) o[i] = 0.0f;
    for (int j = left[b] + warp; j < end[0]; j += WARPS) {
        const size_t at = base + (size_t)j * D + lane * PER;
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) dot += qv[i] * static_cast<float>(k[at + i]);
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
        const float top = fmaxf(m, dot);
        const float kept = expf(m - top);
        const float p = expf(dot - top);
        s = s * kept + p;
        for (int i = 0; i < PER; ++i) o[i] = o[i] * kept + p * static_cast<float>(v[at + i]);
        m = top;
    }

    __shared__ float maxes[WARPS];
    __shared__ float sums[WARPS];
    __shared__ float parts[WARPS][D];
    if (lane == 0) {
        maxes[warp] = m;
        sums[warp] = s;
    }
    for (int i = 0; i < PER; ++i) parts[warp][lane * PER + i] = o[i];
    __syncthreads();
    if (threadIdx.x < D) {
        float top = lowest;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, maxes[w]);
        float total = 0.0f, acc = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (maxes[w] == lowest) continue;
            const float f = expf(maxes[w] - top);
            total += sums[w] * f;
            acc += parts[w][threadIdx.x] * f;
        }
        out[(size_t)bh * D + threadIdx.x] = static_cast<T>(total > 0.0f ? acc / total : 0.0f);
    }
"""

_kernel: Any = None


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


_constants: dict[tuple[float, mx.Dtype], mx.array] = {}


def _constant(value: float, dtype: mx.Dtype) -> mx.array:
    """A one-element array of `value`, made once for every layer of a step (and every step of
    a model's scale) rather than once per layer: each is a host-to-device upload, and a
    scalar made with `mx.array` would sit in MLX's CUDA scalar pool (`smallarrays`)."""
    key = (value, dtype)
    found = _constants.get(key)
    if found is None:
        if len(_constants) >= 256:
            _constants.clear()
        found = _constants[key] = kernel_array([value], dtype)
    return found


def ragged_cuda(
    q: mx.array, k: mx.array, v: mx.array, scale: float, left: mx.array, end: int | mx.array
) -> mx.array:
    """q (B, H, 1, D); k, v (B, H_kv, N, D) whole buffers; row b attends to keys [left[b], end)
    (`end` a number, or an int32 array whose first entry is it)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxd_ragged_decode",
            input_names=["q", "k", "v", "scale", "left", "end"],
            output_names=["out"],
            source=_SOURCE,
        )
    rows, heads, _, dim = q.shape
    (out,) = _kernel(
        inputs=[
            q, k, v, _constant(scale, mx.float32),
            left if left.dtype == mx.int32 else left.astype(mx.int32),
            end if isinstance(end, mx.array) else _constant(end, mx.int32),
        ],
        template=[("T", q.dtype), ("D", dim), ("WARPS", WARPS)],
        grid=(rows * heads * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )  # fmt: skip
    return out


def ragged_reference(
    q: mx.array, k: mx.array, v: mx.array, scale: float, left: mx.array, end: int | mx.array
) -> mx.array:
    """The same attention row by row, with MLX's own kernel on exact slices (any device)."""
    end = end if isinstance(end, int) else to_ints(end)[0]
    outs = [
        mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, start:end], v[b : b + 1, :, start:end], scale=scale
        )
        for b, start in enumerate(to_ints(left))
    ]
    return mx.concatenate(outs, axis=0)


class _Warmed(threading.local):
    """This thread's warm-up: whether one ran or runs, and the multi-token attention shapes it
    ran (MLX's CUDA attention keeps what it builds per thread)."""

    def __init__(self) -> None:
        self.running = False
        self.ran = False
        self.shapes: set[tuple[Any, ...]] = set()


_warmed = _Warmed()


@contextmanager
def warming() -> Iterator[None]:
    """Within (a model's warm-up on its serving thread): the multi-token attention shapes run
    are built by MLX as usual, and later calls of those shapes keep its attention; after it,
    a shape it did not run takes `attend_with_ops` (`unwarmed`)."""
    _warmed.running = True
    try:
        yield
    finally:
        _warmed.running, _warmed.ran = False, True


def unwarmed(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether a call is a multi-token attention with an array mask over a bucketed cache (a
    verify round, a draft catch-up, a short prompt chunk) at a shape this thread's warm-up did
    not run. MLX's CUDA build would first build a cuDNN graph for it in the middle of a round
    (a new key length cost 38-52 ms on the code pair); its plain operations build nothing.
    Before any warm-up on the thread (in-process benches, tests) every call keeps MLX's
    attention."""
    if sinks is not None or queries.shape[2] == 1 or not isinstance(mask, mx.array):
        return False
    if not isinstance(cache, BucketedKVCache | BucketedBatchKVCache):
        return False
    shape = (queries.shape, keys.shape, mask.shape, queries.dtype)
    if _warmed.running:
        _warmed.shapes.add(shape)
        return False
    return _warmed.ran and shape not in _warmed.shapes


def attend_with_ops(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array
) -> mx.array:
    """Attention of q (B, H, L, D) over k, v (B, H_kv, N, D) under a boolean mask that
    broadcasts to (B, 1, L, N), as MLX's operations: two matmuls and a softmax, each head
    group's queries stacked so that one matmul serves them."""
    b, heads, length, dim = q.shape
    groups = heads // k.shape[1]
    q = (q * scale).reshape(b, k.shape[1], groups * length, dim)
    while mask.ndim < 4:
        mask = mask[None]
    if groups > 1:
        mask = mx.tile(mask, (1, 1, groups, 1))
    scores = q @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores, _constant(mx.finfo(scores.dtype).min, scores.dtype))
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(b, heads, length, v.shape[-1])


class _Additive(threading.local):
    """This thread's last boolean mask and its additive form: a forward hands every layer the
    same mask, so it is converted once, not once per layer."""

    def __init__(self) -> None:
        self.mask: mx.array | None = None
        self.dtype: mx.Dtype | None = None
        self.out: mx.array | None = None


_additive = _Additive()


@reset_after_work
def _forget_thread() -> None:
    """A pooled thread's next work (another model, a probe) starts as a fresh thread would:
    no warm-up seen, no mask held."""
    _warmed.__init__()  # type: ignore[misc]
    _additive.__init__()  # type: ignore[misc]


def additive(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean mask as MLX's CUDA attention takes it, 0 where a key is seen and -inf where it
    is not, in `dtype`, made once per mask. MLX converts a boolean mask itself in every call:
    two fills of the broadcast (B, H, L, keys) shape and a select, per layer; on an H200 28
    layers' 9-token attentions over a 1,024-key bucket encoded in 1.8-2.0 ms with the boolean
    mask against 1.0-1.3 with exact keys and a causal one."""
    memo = _additive
    if memo.mask is mask and memo.dtype == dtype and memo.out is not None:
        return memo.out
    out = mx.where(mask, _constant(0.0, dtype), _constant(-mx.inf, dtype))
    memo.mask, memo.dtype, memo.out = mask, dtype, out
    return out


def batched_decode(queries: mx.array, cache: Any, sinks: Any) -> bool:
    """Whether a call is single-token attention over a bucketed batch cache."""
    return sinks is None and isinstance(cache, BucketedBatchKVCache) and queries.shape[2] == 1


def kernel_serves(head_dim: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= WARPS * 32


def route_module(module: Any, ragged: Ragged, serves: Callable[[int], bool]) -> bool:
    """Send `module`'s single-token attention over a bucketed batch cache to `ragged` (for head
    dims `serves` accepts), and multi-token attention at shapes warm-up did not run to
    `attend_with_ops` (`unwarmed`); every other call keeps the function it had, a boolean mask
    handed to it made additive once per forward (`additive`). Idempotent: a
    module already routed is routed afresh around its original. False where it has no such
    function."""
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        return False
    original = getattr(original, "__wrapped__", original)

    def attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        if batched_decode(queries, cache, sinks) and serves(queries.shape[-1]):
            return ragged(queries, keys, values, scale, cache.left_padding, cache._idx)
        single = sinks is None and queries.shape[2] == 1
        if single and getattr(cache, "ragged_end", None) is not None and serves(queries.shape[-1]):
            # a compiled step's layer (`compiledstep`): its bounds are arrays
            return ragged(queries, keys, values, scale, cache.ragged_left, cache.ragged_end)
        if unwarmed(queries, keys, cache, mask, sinks):
            return attend_with_ops(queries, keys, values, scale, mask)
        if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
            mask = additive(mask, queries.dtype)
        extra = {} if sinks is None else {"sinks": sinks}
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **extra)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    module.scaled_dot_product_attention = attention
    return True


def install_batched_decode(
    ragged: Ragged = ragged_cuda, serves: Callable[[int], bool] = kernel_serves
) -> None:
    """Route every mlx-lm model's batched single-token attention to `ragged` (the backend
    configuration does it once, on CUDA). mlx-lm's model modules bind
    `base.scaled_dot_product_attention` when imported, so `base` is routed for the ones
    imported later and each one already imported for itself. Idempotent."""
    from mlx_lm.models import base

    route_module(base, ragged, serves)
    for name, module in list(sys.modules.items()):
        model_module = name.startswith("mlx_lm.models.") and module not in (None, base)
        if model_module and hasattr(module, "scaled_dot_product_attention"):
            route_module(module, ragged, serves)
