"""The wire layer without a server: decoding turns every malformed body into InvalidRequest,
the status table maps engine error types, and encoded objects keep Ollama's omitted fields."""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxd.api.codec import decode, ndjson_line, sse_event
from mlxd.api.durations import MAX_SECONDS, DurationError, parse_keep_alive
from mlxd.api.errors import (
    ApiError,
    BodyTooLarge,
    GenerationFailed,
    InvalidRequest,
    message_of,
    status_of,
)
from mlxd.api.types import (
    ChatCompletionRequest,
    ChatRequest,
    ChunkChoice,
    Completion,
    CompletionRequest,
    CopyRequest,
    Delta,
    GenerateRequest,
    GenerateResponse,
    ModelRequest,
)
from mlxd.engine.manager import InsufficientMemory, QueueFull
from mlxd.engine.options import OptionsError
from mlxd.engine.pairing import ModelNotPulled, ModelUnavailable
from mlxd.engine.prompt import PromptError
from mlxd.registry.names import InvalidModelName

REQUESTS = [GenerateRequest, ChatRequest, ChatCompletionRequest, CompletionRequest,
            ModelRequest, CopyRequest]  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidRequest("x"), 400),
        (OptionsError("x"), 400),
        (DurationError("x"), 400),
        (PromptError("x"), 400),
        (InvalidModelName("x"), 400),
        (ModelNotPulled("x"), 404),
        (BodyTooLarge("x"), 413),
        (QueueFull(), 503),
        (InsufficientMemory("x"), 500),
        (ModelUnavailable("x"), 500),
        (GenerationFailed("x"), 500),
        (ApiError(404, "x"), 404),
        (RuntimeError("x"), 500),
    ],
)
def test_status_table(exc: Exception, status: int) -> None:
    assert status_of(exc) == status


def test_messages_are_always_encodable() -> None:
    text = message_of(RuntimeError("bad \ud800 text"))
    assert text.encode("utf-8")
    assert message_of(RuntimeError()) == "RuntimeError"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"", "missing request body"),
        (b"[1]", "request body must be a JSON object"),
        (b'{"prompt": 5}', "invalid value for field 'prompt': expected string"),
        (b'{"context": [1, "a"]}', "invalid value for field 'context[1]': expected integer"),
        (b'{"keep_alive": []}', "field 'keep_alive': expected number or string"),
        (b'{"prompt": "\\ud800"}', "invalid JSON"),
        (b'{"prompt": "\xff"}', "invalid JSON"),
        (b'{"options": {"seed": ' + b"9" * 5000 + b"}}", "out of range"),
        (b'{"options": ' + b"[" * 1000 + b"]" * 1000 + b"}", "options"),
        (b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply"),
        (b'{"options": {"seed": NaN}}', "invalid JSON"),
    ],
)
def test_decode_errors_name_the_problem(raw: bytes, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says.replace("[", r"\[").replace("]", r"\]")):
        decode(raw, GenerateRequest)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    ["model", "prompt", "messages", "options", "keep_alive", "context", "stream", "stop",
     "seed", "max_tokens", "temperature", "tools", "think", "format", "stream_options",
     "response_format", "name", "source", "role", "content"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(REQUESTS), st.dictionaries(FIELDS, JSON, max_size=5))
def test_any_json_object_decodes_or_is_invalid(kind: type, body: dict[str, Any]) -> None:
    with contextlib.suppress(InvalidRequest):
        decode(json.dumps(body).encode(), kind)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_are_invalid(raw: bytes) -> None:
    for kind in REQUESTS:
        with contextlib.suppress(InvalidRequest):
            decode(raw, kind)


@pytest.mark.parametrize("value", [1e18, MAX_SECONDS * 2, float("nan"), "2562048h", 10**400])
def test_keep_alive_past_gos_range_is_refused(value: Any) -> None:
    with pytest.raises(DurationError):
        parse_keep_alive(value)


@pytest.mark.parametrize(("value", "seconds"), [(-1, float("inf")), (-1e30, float("inf")),
                                                 ("2562047h", 2562047 * 3600.0), (0, 0.0)])  # fmt: skip
def test_keep_alive_in_range(value: Any, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


def test_chunks_omit_what_ollama_omits() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=timezone.utc)
    line = ndjson_line(GenerateResponse("tiny", at, "hé", False))
    assert (
        line
        == b'{"model":"tiny","created_at":"2026-01-02T03:04:05.123456Z","response":"h\xc3\xa9","done":false}\n'
    )
    final = json.loads(ndjson_line(GenerateResponse("tiny", at, "", True, done_reason="stop",
                                                    eval_count=0, context=[])))  # fmt: skip
    assert final["eval_count"] == 0 and final["context"] == [] and "total_duration" not in final


def test_openai_chunks_keep_a_null_finish_reason() -> None:
    chunk = Completion("c-1", "chat.completion.chunk", 1, "tiny", "fp",
                       [ChunkChoice(0, Delta(content=""), None)])  # fmt: skip
    event = sse_event(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    obj = msgspec.json.decode(event[6:])
    assert obj["choices"] == [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]
    assert "usage" not in obj


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_every_streamed_line_survives_a_line_reader(text: str) -> None:
    """httpx's `iter_lines` (ollama-python's, LiteLLM's reader) and `str.splitlines` break lines
    at U+0085, U+2028 and U+2029, which JSON allows raw: a token holding one must not cut its
    NDJSON line or SSE event in two."""
    obj = {"response": "a\u2028b\u2029c\x85d" + text}
    for encoded, head in ((ndjson_line(obj), b""), (sse_event(obj), b"data: ")):
        lines = [line for line in httpx.Response(200, content=encoded * 2).iter_lines() if line]
        assert len(lines) == 2
        assert lines[0].encode().startswith(head)
        assert json.loads(lines[0].encode()[len(head) :]) == obj
