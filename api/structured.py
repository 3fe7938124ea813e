"""Structured outputs on the wire: Ollama's `format`, OpenAI's `response_format` and mlxd's
`options.grammar` become one `GrammarSpec`, compiled once before the model is touched so a bad
schema is a 400 naming the problem, never a stream that fails."""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlxd.api.errors import ApiError
from mlxd.api.types import ResponseFormat
from mlxd.engine.grammar import GrammarError, GrammarSpec, validate

GRAMMAR_KEYS = ("lark", "regex", "json_schema")


def from_format(fmt: Any) -> GrammarSpec | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema object."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return GrammarSpec("json")
    if isinstance(fmt, dict):
        return GrammarSpec.schema(fmt)
    raise ApiError(
        400, f'invalid format: {json.dumps(fmt)}; expected "json" or a valid JSON Schema object'
    )


def from_options(options: Any) -> GrammarSpec | None:
    """mlxd's `options.grammar`: a Lark grammar as a string, or one of {"lark": text},
    {"regex": pattern}, {"json_schema": schema}."""
    if not isinstance(options, dict) or options.get("grammar") is None:
        return None
    grammar = options["grammar"]
    if isinstance(grammar, str):
        return GrammarSpec("lark", grammar)
    if isinstance(grammar, dict) and len(grammar) == 1:
        ((kind, source),) = grammar.items()
        if kind == "json_schema" and isinstance(source, dict):
            return GrammarSpec.schema(source)
        if kind in ("lark", "regex") and isinstance(source, str):
            return GrammarSpec(kind, source)
    raise ApiError(
        400,
        'invalid option "grammar": expected a Lark grammar string or one of {"lark": "..."},'
        ' {"regex": "..."}, {"json_schema": {...}}',
    )


def from_response_format(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """OpenAI's `response_format`: text, json_object, or json_schema with its `schema`."""
    if fmt is None or fmt.type in (None, "text"):
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json")
    if fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs a 'schema' object")
        return GrammarSpec.schema(schema)
    raise ApiError(400, f"invalid response_format type: {json.dumps(fmt.type)}")


def one_of(*specs: GrammarSpec | None) -> GrammarSpec | None:
    """The request's grammar; two ways of asking for one conflict (400)."""
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        raise ApiError(400, "conflicting structured output: give only one of format,"
                       " response_format and options.grammar")  # fmt: skip
    return given[0] if given else None


async def checked(spec: GrammarSpec | None) -> GrammarSpec | None:
    """Compile the grammar (off the event loop: a large schema takes a while); 400 when it
    cannot be."""
    if spec is None:
        return None
    try:
        await run_in_threadpool(validate, spec)
    except GrammarError as exc:
        raise ApiError(400, str(exc)) from exc
    return spec


async def request_grammar(fmt: Any, options: Any) -> GrammarSpec | None:
    """A native request's grammar from `format` and `options.grammar`."""
    return await checked(one_of(from_format(fmt), from_options(options)))
