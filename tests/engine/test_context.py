"""One rule for a row's context: what the budget reserves, what the API admits and where the
scheduler stops are the same number."""

from __future__ import annotations

from pathlib import Path

from mlxd.engine.context import DEFAULT_NUM_CTX, row_context, trained_length
from mlxd.engine.memory import estimate
from mlxd.engine.options import parse_options
from mlxd.engine.scheduler import generation_limit
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import TinyPair

LONG = {"max_position_embeddings": 32768}


def entry(**fields: object) -> ModelEntry:
    return ModelEntry("m", "org/m", **fields)  # type: ignore[arg-type]


def test_the_trained_length_comes_from_the_entry_then_the_config() -> None:
    assert trained_length(entry(context_length=1000), LONG) == 1000
    assert trained_length(entry(), LONG) == 32768
    assert trained_length(entry(), {"text_config": {"seq_length": 512}}) == 512
    assert trained_length(entry(), {"max_position_embeddings": True}) == 4096  # not a length
    assert trained_length(entry(), {}) == 4096


def test_a_row_holds_num_ctx_within_the_trained_length() -> None:
    assert row_context(entry(), LONG) == DEFAULT_NUM_CTX
    assert row_context(entry(options={"num_ctx": 8192}), LONG) == 8192
    assert row_context(entry(options={"num_ctx": 8192}), {"n_positions": 2048}) == 2048
    assert row_context(entry(context_length=300), LONG) == 300


def test_a_request_narrows_its_row_but_never_widens_it() -> None:
    pairing = entry(options={"num_ctx": 8192})
    wide = parse_options(pairing.options, {"num_ctx": 100_000})
    narrow = parse_options(pairing.options, {"num_ctx": 1000})
    assert row_context(pairing, LONG, wide) == 8192  # what the budget reserved
    assert row_context(pairing, LONG, narrow) == 1000
    assert row_context(pairing, LONG, parse_options(pairing.options)) == 8192
    assert row_context(pairing, LONG, parse_options({"num_ctx": 1})) == 4  # Ollama's floor


def test_generation_stops_at_the_row_context() -> None:
    opts = parse_options({})
    assert generation_limit(opts, 100, 4096) == 3996
    assert generation_limit(parse_options({"num_predict": 10}), 100, 4096) == 10
    assert generation_limit(opts, 4096, 4096) == 1  # a full row still makes its one token


def test_the_budget_reserves_the_row_context_for_every_row(tiny_pair: TinyPair) -> None:
    small = ModelEntry("m", str(tiny_pair.target), options={"num_ctx": 64})
    need = estimate([Path(tiny_pair.target)], small, 3, False)
    assert need.context == 64 and need.rows == 3
    wide = ModelEntry("m", str(tiny_pair.target), options={"num_ctx": 128})
    assert estimate([Path(tiny_pair.target)], wide, 3, False).kv == 2 * need.kv
