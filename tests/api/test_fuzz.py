"""Random request bodies against the real server: never a 500, never a broken connection."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import RunningServer

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=5,
)
OPTION_NAMES = ["temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
                "repeat_last_n", "presence_penalty", "num_ctx", "draft_num_predict",
                "draft_method", "kv_bits", "kv_group_size", "mirostat"]  # fmt: skip
OPTIONS = st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=4)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "USER", "x"]) | VALUES},
    optional={"content": st.text(max_size=20) | VALUES, "tool_calls": VALUES, "images": VALUES},
)
FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "/api/generate": {
        "prompt": st.text(max_size=20) | VALUES, "suffix": VALUES, "system": VALUES,
        "template": st.sampled_from(["{{ .Prompt }}", "{{ if .System }}", "{{ .X }}"]) | VALUES,
        "context": st.lists(st.integers(-5, 600), max_size=4) | VALUES, "raw": VALUES,
        "format": VALUES, "keep_alive": st.sampled_from(["5m", "-1", "1x", -1, 0.5]) | VALUES,
        "think": VALUES, "options": OPTIONS | VALUES, "stream": VALUES,
    },
    "/api/chat": {
        "messages": st.lists(MESSAGE, max_size=3) | VALUES, "tools": VALUES,
        "options": OPTIONS | VALUES, "keep_alive": VALUES, "stream": VALUES, "think": VALUES,
    },
    "/v1/chat/completions": {
        "messages": st.lists(MESSAGE, min_size=1, max_size=3) | VALUES, "stop": VALUES,
        "temperature": VALUES, "top_p": VALUES, "seed": VALUES, "stream": VALUES,
        "stream_options": VALUES, "response_format": VALUES, "reasoning_effort": VALUES,
        "frequency_penalty": VALUES, "tools": VALUES,
    },
    "/v1/completions": {
        "prompt": st.text(max_size=20) | VALUES, "suffix": VALUES, "stop": VALUES,
        "seed": VALUES, "temperature": VALUES, "top_p": VALUES, "stream": VALUES,
    },
}  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from(list(FIELDS)))
    body = {"model": draw(st.sampled_from(["tiny", "pair"]) | VALUES)}
    body.update(draw(st.fixed_dictionaries({}, optional=FIELDS[path])))
    # keep generations short: the point is the input side
    if path.startswith("/api/") and isinstance(body.get("options"), dict):
        body["options"]["num_predict"] = 1
    elif path.startswith("/api/"):
        body.setdefault("options", {"num_predict": 1})
    else:
        body["max_tokens"] = 1
    return path, body


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests())
def test_random_requests_never_500(http: httpx.Client, request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    r = http.post(path, content=json.dumps(body).encode())
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()
    elif "ndjson" in r.headers["content-type"]:
        lines = [json.loads(line) for line in r.text.splitlines()]
        assert lines and all("error" not in line for line in lines), r.text
    elif "event-stream" in r.headers["content-type"]:
        assert r.text.endswith("data: [DONE]\n\n"), r.text
    else:
        r.json()
