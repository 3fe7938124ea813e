"""Request options: every field parsed, every range enforced, nothing but OptionsError raised."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.engine.options import OptionsError, SamplingOptions, parse_options
from mlxd.registry.bounds import BOUNDS, FLOAT_FLOOR, INT64_MAX, INT64_MIN, MAX_DRAFT_TOKENS


def test_every_option_has_a_parser() -> None:
    """Each field parses its default (or a valid value where the default is None)."""
    valid = {"seed": 1, "num_ctx": 8, "draft_num_predict": 4, "kv_bits": 4, "stop": ["x"]}
    for f in fields(SamplingOptions):
        value = valid.get(f.name, f.default)
        assert getattr(parse_options({f.name: value}), f.name) == (
            tuple(value) if isinstance(value, list) else value
        )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 101),
        ("top_p", math.nan),
        ("min_p", 5),
        ("min_p", -0.5),
        ("repeat_penalty", 0),
        ("repeat_penalty", -1.5),
        ("repeat_penalty", math.inf),
        ("presence_penalty", 1e9),
        ("frequency_penalty", -math.inf),
        ("num_predict", 2**31),
        ("num_predict", -3),
        ("num_predict", math.nan),
        ("num_predict", 1e300),
        ("top_k", math.inf),
        ("top_k", 2**31),
        ("seed", 2**64),
        ("seed", INT64_MAX + 1),
        ("seed", INT64_MIN - 1),
        ("seed", -math.inf),
        ("repeat_last_n", -2),
        ("num_ctx", 2**31),
        ("draft_num_predict", MAX_DRAFT_TOKENS + 1),
        ("draft_num_predict", -1),
        ("kv_bits", 2),
        ("kv_group_size", 16),
        ("quantized_kv_start", -1),
        ("temperature", "hot"),
        ("num_predict", True),
        ("stop", [1]),
        ("draft_method", "magic"),
    ],
)
def test_out_of_range_is_an_options_error_naming_the_option(key: str, value: Any) -> None:
    with pytest.raises(OptionsError, match=key):
        parse_options({key: value})


@pytest.mark.parametrize(
    ("key", "value", "parsed"),
    [
        ("temperature", -1.0, 0.0),  # greedy, as llama.cpp reads a negative temperature
        ("top_k", -5, 0),  # disabled
        ("num_ctx", 1, 4),
        ("seed", -1, None),  # a random seed
        ("seed", INT64_MIN, None),
        ("seed", INT64_MAX, INT64_MAX),
        ("num_predict", 3.7, 3),  # Ollama truncates a float given for an integer
        ("num_predict", -2, -2),
        ("top_p", 1, 1.0),
        ("top_p", 1.5, 1.0),  # Ollama's samplers: all tokens
        ("top_p", 0, FLOAT_FLOOR),  # the most likely token alone
        ("top_p", -1, FLOAT_FLOOR),
        ("draft_num_predict", MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS),
        ("stop", "x", ("x",)),
    ],
)
def test_ollama_clamps_and_conversions(key: str, value: Any, parsed: Any) -> None:
    assert getattr(parse_options({key: value}), key) == parsed


def test_the_request_layer_wins_and_registry_values_are_checked_too() -> None:
    opts = parse_options({"temperature": 0.2, "top_k": 5}, {"temperature": 0.0})
    assert opts.temperature == 0.0 and opts.top_k == 5
    with pytest.raises(OptionsError, match="min_p"):
        parse_options({"min_p": 2}, {})


def test_bounds_say_their_range() -> None:
    for key, bound in BOUNDS.items():
        assert bound.says, key


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in fields(SamplingOptions)]), JSON_VALUES))
def test_any_value_parses_or_raises_options_error(options: dict[str, Any]) -> None:
    try:
        opts = parse_options(options)
    except OptionsError:
        return
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        assert math.isfinite(getattr(opts, name))
    assert opts.seed is None or 0 <= opts.seed <= INT64_MAX
    assert 0 < opts.top_p <= 1 and 0 <= opts.min_p <= 1 and opts.repeat_penalty > 0


def test_positive_values_below_the_floor_are_raised_to_it() -> None:
    """The sampler's float32 would make 1e-300 a 0 to divide by; 0 itself keeps its meaning."""
    opts = parse_options({"temperature": 1e-300, "top_p": 1e-300, "repeat_penalty": 1e-300})
    assert opts.temperature == opts.top_p == opts.repeat_penalty == FLOAT_FLOOR
    assert parse_options({"temperature": 0}).greedy
    assert parse_options({"temperature": 0.5}).temperature == 0.5
