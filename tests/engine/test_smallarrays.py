"""`kernel_array` gives the values, dtype and shape asked for, whatever its padding (its
buffer's size, which keeps it out of MLX's CUDA scalar pool, is not visible from Python)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.engine.smallarrays import kernel_array


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([3], mx.uint32),
        ([1, 2], mx.int32),
        ([0.125], mx.float32),
        ([7, 8, 9, 10, 11], mx.uint32),
        ([True, False], mx.bool_),
    ],
)
def test_values_dtype_and_shape_are_those_asked_for(values: list, dtype: mx.Dtype) -> None:
    got = kernel_array(values, dtype)
    assert got.dtype == dtype
    assert got.shape == (len(values),)
    assert got.tolist() == values
    assert mx.array_equal(got * 2, mx.array(values, dtype=dtype) * 2).item()
