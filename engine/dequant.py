"""Quantized projections on a CPU: forwards of many rows multiply a dequantized weight.

MLX's CPU quantized matmul gains nothing from the rows it multiplies at once: on a 2-core
x86-64 machine a 4-bit 4864 x 896 projection took 3.8 ms for one row, 30 for 8 and 1,926 for
512, where dequantizing the weight to float32 and multiplying on MKL took 9.6, 10.1 and 61 ms.
So where an optimized BLAS serves MLX's float32 matmuls (`Backend.float32_compute`), a
quantized projection's forward of `MIN_ROWS` rows or more (a prompt, a batch, a verify round)
multiplies a float32 copy of its weight made for that call and dropped after it; fewer rows (a
decode step) keep the packed kernel. A weight larger than `BLOCK_BYTES` in float32 (a large
vocabulary's output projection: 2.2 GB for 152k x 3584) is copied and multiplied a block of
output features at a time, so the copy held at once stays bounded. On MLX's reference BLAS
the float32 matmul is slower than the packed kernel at every row count, so nothing changes
there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = ["BLOCK_BYTES", "MIN_ROWS", "DequantizingLinear", "install"]

MIN_ROWS = 3  # 2 rows: 7.5 ms packed against 9.4 dequantized (the projection above)
BLOCK_BYTES = 256 * 1024 * 1024  # the most of a float32 copy held at once


class DequantizingLinear(nn.QuantizedLinear):
    """A quantized projection whose forwards of `MIN_ROWS` rows or more dequantize first."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.size < MIN_ROWS * x.shape[-1]:
            return super().__call__(x)
        weight, scales, biases = self["weight"], self["scales"], self.get("biases")
        block = max(1, BLOCK_BYTES // (4 * x.shape[-1]))  # output features a copy holds
        if block >= weight.shape[0]:
            y = x @ self._dequantized(weight, scales, biases).T
        else:
            y = mx.concatenate(
                [
                    x @ self._dequantized(
                        weight[a : a + block], scales[a : a + block],
                        None if biases is None else biases[a : a + block],
                    ).T
                    for a in range(0, weight.shape[0], block)
                ],
                axis=-1,
            )  # fmt: skip
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _dequantized(self, weight: mx.array, scales: mx.array, biases: mx.array | None) -> mx.array:
        return mx.dequantize(weight, scales, biases, self.group_size, self.bits, mode=self.mode)


def install(model: nn.Module) -> int:
    """Make `model`'s quantized projections `DequantizingLinear`s (their class only: the arrays
    stay where they are); the number changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = DequantizingLinear
            changed += 1
    return changed
