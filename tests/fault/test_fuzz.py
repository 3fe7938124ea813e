"""Property-based bodies for every route, against a real server on a tiny model.

The bodies are built as JSON *text*, so they can hold what `json.dumps` never writes: integers
of 5,000 digits, `NaN` and `Infinity` tokens, 1,000 levels of nesting, lone surrogate escapes;
besides those, wrong types, absurd option values, bodies that are not objects or not JSON.
For every request:
- the status is never 5xx;
- a non-2xx answer is a JSON object with `error`; a 2xx body is valid JSON (NDJSON and SSE
  line by line; an `error` line inside a stream is allowed, a broken stream is not);
- the next request on the same keep-alive connection succeeds.

Generation is bounded by the registry (a 96-token context), so absurd `num_predict` values
stay cheap. The default run sends a few hundred requests, deterministically;
`MLXD_FAULT_FULL=1` sends over 10,000.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServerThread
from tests.fixtures.tiny_models import TinyPair

FULL = os.environ.get("MLXD_FAULT_FULL") == "1"
# 10 fuzzed routes (or route groups): 40 examples each by default, 1,100 each in full mode.
EXAMPLES = 1100 if FULL else 40
SERVED = ("tiny", "pair")
CONTEXT = 96

FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- JSON text with what json.dumps will not write --------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON value written verbatim."""

    text: str

    def __repr__(self) -> str:  # failing examples stay readable
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


HUGE = [
    Raw("9" * 5000),
    Raw("-" + "1" * 5000),
    Raw("1" + "0" * 5000 + ".5"),
    Raw("123456789012345678901234567890"),
    Raw("1e400"),
    Raw("-1e400"),
    Raw("1e-400"),
]
NONFINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity")]
SURROGATES = [Raw('"\\ud800"'), Raw('"x\\udfff"'), Raw('"\\ud83d\\u0041"'), Raw('"\\udc00\\ud800"')]
DEEP = [
    Raw("[" * 1000 + "]" * 1000),
    Raw('{"a":' * 1000 + "0" + "}" * 1000),
    Raw("[" * 100_000 + "]" * 100_000),
]
ODD_STRINGS = [
    "",
    "\x00",
    "\u202e",
    "\ufeff",
    "<|im_end|>",
    "</s>",
    "{{ .Prompt }}",
    Raw(json.dumps("a" * 3000)),
]
SPECIALS = st.sampled_from([*HUGE, *NONFINITE, *SURROGATES, *DEEP, *ODD_STRINGS])

LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    SPECIALS,
)
WILD = st.recursive(
    LEAF,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)


def maybe(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right kind, sometimes anything at all."""
    return st.one_of(plausible, plausible, WILD)


def obj(
    required: dict[str, st.SearchStrategy[Any]] | None = None,
    **optional: st.SearchStrategy[Any],
) -> st.SearchStrategy[dict[str, Any]]:
    fields = st.fixed_dictionaries(
        {k: maybe(v) for k, v in (required or {}).items()},
        optional={k: maybe(v) for k, v in optional.items()},
    )
    extra = st.dictionaries(st.text(max_size=8), WILD, max_size=2)
    return st.builds(lambda f, e: {**e, **f}, fields, extra)


NOT_JSON = st.sampled_from(
    [b"", b" ", b"\xff\xfe{", b'{"model": "tiny"', b"{}}", b"null", b"[]", b'"x"', b"\x00"]
)


class Body(bytes):
    """A request body whose repr stays short in failure reports."""

    def __repr__(self) -> str:
        head = bytes(self[:300])
        return f"Body({head!r}{f'... ({len(self)} bytes)' if len(self) > 300 else ''})"


def body(*shapes: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Body]:
    """Mostly the route's own shapes; sometimes any JSON value, or bytes that are not JSON."""
    as_json = st.one_of(*shapes, *shapes, WILD).map(lambda v: to_json(v).encode("utf-8"))
    return st.one_of(as_json, as_json, NOT_JSON, st.binary(max_size=16)).map(Body)


def exact(
    required: dict[str, st.SearchStrategy[Any]], **optional: st.SearchStrategy[Any]
) -> st.SearchStrategy[dict[str, Any]]:
    """Every field of the right type (values may still be absurd): requests that get as far
    as the engine."""
    return st.fixed_dictionaries(required, optional=optional)


# -- what the routes take ------------------------------------------------------------------

MODEL = st.one_of(
    st.sampled_from(
        [*SERVED, "tiny:latest", "TINY", "nosuch", "", "a/b/c:d", Raw(json.dumps("x:" + "y" * 300))]
    ),
    st.text(max_size=10),
)
TEXT = st.text(max_size=24)
INT = st.one_of(st.integers(-5, 64), st.sampled_from([10**30, -(10**30), 2**63, 2**64, -(2**63)]))
FLOAT = st.one_of(st.floats(-10, 10), st.sampled_from([0.0, 1e308, -1e308, 5e-324, -5e-324, 1e-30]))
OPTION_VALUES: dict[str, st.SearchStrategy[Any]] = dict(
    temperature=FLOAT,
    top_k=INT,
    top_p=FLOAT,
    min_p=FLOAT,
    seed=INT,
    num_predict=INT,
    stop=st.one_of(st.lists(st.text(max_size=4), max_size=3), st.text(max_size=3)),
    repeat_penalty=FLOAT,
    repeat_last_n=INT,
    presence_penalty=FLOAT,
    frequency_penalty=FLOAT,
    num_ctx=INT,
    draft_num_predict=INT,
    draft_method=st.sampled_from(["auto", "model", "lookup", "off", "bogus"]),
    kv_bits=st.sampled_from([4, 8, 2, 0, 16]),
    kv_group_size=st.sampled_from([32, 64, 128, 7]),
    quantized_kv_start=INT,
)
OPTIONS = obj(**OPTION_VALUES)
ABSURD_OPTIONS = exact({}, **OPTION_VALUES)
KEEP_ALIVE = st.sampled_from(
    ["5m", "1h", "0", "-1", "-1s", "forever", "10", 300, 1.5, -1, 10**30, "9999999999h", "1e400s"]
)
FORMAT = st.sampled_from(["json", "", "xml", {"type": "object"}, {}, ["json"]])
THINK = st.sampled_from([True, False, "high", "low", "bogus", 1])
ROLE = st.sampled_from(["user", "assistant", "system", "tool", "USER", "bogus", ""])
MESSAGE = obj(
    {"role": ROLE},
    content=TEXT,
    images=st.lists(TEXT, max_size=2),
    tool_calls=st.lists(WILD, max_size=2),
    tool_name=TEXT,
    thinking=TEXT,
)
MESSAGES = st.lists(maybe(MESSAGE), max_size=3)
STREAM = st.booleans()

GENERATE = obj(
    {"model": MODEL},
    prompt=TEXT,
    suffix=TEXT,
    system=TEXT,
    template=TEXT,
    context=st.lists(INT, max_size=4),
    raw=st.booleans(),
    stream=STREAM,
    format=FORMAT,
    options=OPTIONS,
    keep_alive=KEEP_ALIVE,
    think=THINK,
    images=st.lists(TEXT, max_size=2),
)
CHAT = obj(
    {"model": MODEL, "messages": MESSAGES},
    stream=STREAM,
    format=FORMAT,
    options=OPTIONS,
    keep_alive=KEEP_ALIVE,
    tools=st.lists(WILD, max_size=2),
    think=THINK,
)
CHAT_TURNS = st.lists(
    exact({"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXT}),
    min_size=1,
    max_size=3,
)
GENERATE_ABSURD = exact(
    {"model": st.sampled_from(SERVED), "prompt": TEXT, "options": ABSURD_OPTIONS},
    stream=STREAM,
    raw=st.booleans(),
    suffix=TEXT,
)
CHAT_ABSURD = exact(
    {"model": st.sampled_from(SERVED), "messages": CHAT_TURNS, "options": ABSURD_OPTIONS},
    stream=STREAM,
)
SHOW = obj(model=MODEL, name=MODEL, verbose=st.booleans())
PULL = obj(
    model=st.one_of(MODEL, st.sampled_from(["hf.co/org/repo", "qwen2.5-coder:7b", "org/repo"])),
    name=MODEL,
    stream=STREAM,
    insecure=st.booleans(),
)
NOT_SERVED = MODEL.filter(lambda m: not isinstance(m, str) or m.split(":")[0].lower() not in SERVED)
DELETE = obj(model=NOT_SERVED, name=NOT_SERVED)
COPY = obj(source=MODEL, destination=MODEL)

PART = st.one_of(
    obj({"type": st.just("text")}, text=TEXT),
    obj({"type": st.just("image_url")}, image_url=obj(url=TEXT)),
)
V1_MESSAGE = obj({"role": ROLE}, content=st.one_of(TEXT, st.lists(PART, max_size=2)), name=TEXT)
V1_COMMON: dict[str, st.SearchStrategy[Any]] = {
    "stream": STREAM,
    "stream_options": obj(include_usage=st.booleans()),
    "max_tokens": INT,
    "temperature": FLOAT,
    "top_p": FLOAT,
    "seed": INT,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "frequency_penalty": FLOAT,
    "presence_penalty": FLOAT,
    "n": INT,
    "user": TEXT,
}
V1_CHAT = obj(
    {"model": MODEL, "messages": st.lists(maybe(V1_MESSAGE), max_size=3)},
    max_completion_tokens=INT,
    response_format=st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": 5}]
    ),
    tools=st.lists(WILD, max_size=2),
    reasoning_effort=st.sampled_from(["none", "low", "high", "bogus"]),
    reasoning=obj(effort=st.sampled_from(["low", "bogus"])),
    logprobs=st.booleans(),
    **V1_COMMON,
)
V1_ABSURD: dict[str, st.SearchStrategy[Any]] = {
    "stream": STREAM,
    "max_tokens": INT,
    "temperature": FLOAT,
    "top_p": FLOAT,
    "seed": INT,
    "stop": st.lists(st.text(max_size=3), max_size=4),
    "frequency_penalty": FLOAT,
    "presence_penalty": FLOAT,
}
V1_CHAT_ABSURD = exact({"model": st.sampled_from(SERVED), "messages": CHAT_TURNS}, **V1_ABSURD)
V1_COMPLETIONS_ABSURD = exact({"model": st.sampled_from(SERVED), "prompt": TEXT}, **V1_ABSURD)
V1_COMPLETIONS = obj(
    {"model": MODEL, "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=2), st.lists(INT))},
    suffix=TEXT,
    echo=st.booleans(),
    **V1_COMMON,
)

# -- the property --------------------------------------------------------------------------


def strict_json(data: bytes) -> Any:
    """JSON as the spec has it: no NaN or Infinity, valid UTF-8."""

    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(data.decode("utf-8"), parse_constant=refuse)


def check_success_body(content_type: str, data: bytes) -> None:
    """Valid JSON; a stream is whole: it ends with its final object, `[DONE]`, or an error."""
    if content_type.startswith("application/json"):
        strict_json(data)
    elif content_type.startswith("application/x-ndjson"):
        objs = [strict_json(line) for line in data.splitlines() if line.strip()]
        assert objs and all(isinstance(o, dict) for o in objs), "an empty or non-object line"
        last = objs[-1]
        ended = last.get("done") is True or last.get("status") == "success" or "error" in last
        assert ended, f"the stream stopped before its final object: {last}"
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in data.splitlines() if line.startswith(b"data: ")]
        assert events, "an empty event stream"
        for event in events[:-1]:
            assert isinstance(strict_json(event), dict)
        assert events[-1] == b"[DONE]" or "error" in strict_json(events[-1]), (
            f"the stream stopped before [DONE]: {events[-1]!r}"
        )


def client_port(response: httpx.Response) -> int:
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def problem_with(http: httpx.Client, method: str, path: str, content: bytes) -> str | None:
    """What is wrong with the answer to one request, or with the connection after it."""
    with http.stream(
        method, path, content=content, headers={"content-type": "application/json"}
    ) as r:
        port = client_port(r)
        data = r.read()
    if r.status_code >= 500:
        return f"{r.status_code} {data[:300]!r}"
    try:
        if r.status_code >= 400:
            error = strict_json(data)
            if not (isinstance(error, dict) and "error" in error):
                return f"{r.status_code} without an error object: {data[:300]!r}"
        else:
            check_success_body(r.headers.get("content-type", ""), data)
    except (ValueError, AssertionError) as exc:
        return f"{r.status_code} invalid body {data[:300]!r}: {exc}"
    with http.stream("GET", "/api/version") as follow:
        follow.read()
        if follow.status_code != 200 or client_port(follow) != port:
            return f"{r.status_code}, then the next request on its connection failed"
    return None


def exchange(base: str, method: str, path: str, content: bytes) -> None:
    """One request and a follow-up on a connection of its own (so examples stay independent);
    every broken property is raised from one place, so a replayed example fails the same way."""
    with httpx.Client(base_url=base, timeout=120, verify=False) as http:
        try:
            problem = problem_with(http, method, path, content)
        except httpx.TransportError as exc:
            problem = f"the connection broke: {type(exc).__name__}: {exc}"
    if problem is not None:
        raise AssertionError(f"{method} {path} {content[:300]!r} -> {problem}")


@pytest.fixture(scope="module")
def base(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzz")
    registry = root / "models.yaml"
    options = f"    context_length: {CONTEXT}\n    options:\n      num_predict: 4\n"
    registry.write_text(
        "models:\n"
        f"  tiny:\n    target: {tiny_pair.target}\n{options}"
        f"  pair:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n{options}",
        encoding="utf-8",
    )
    with ServerThread(registry, cache_dir=root / "kv", max_loaded=2) as info:
        yield info.base_url


def test_paths_exist(base: str) -> None:
    """Every route fuzzed here is served (a method it does not take gets 405, not 404): a
    renamed route fails loudly rather than fuzzing 404s."""
    fuzzed = (
        "/api/generate", "/api/chat", "/api/show", "/api/pull", "/api/copy", "/api/delete",
        "/api/ps", "/api/tags", "/v1/chat/completions", "/v1/completions", "/v1/models",
        "/v1/models/x", "/api/version", "/api/mlxd/stats",
    )  # fmt: skip
    for path in fuzzed:
        assert httpx.request("PATCH", f"{base}{path}").status_code == 405, path


@FUZZ
@given(content=body(GENERATE, GENERATE_ABSURD))
def test_generate(base: str, content: bytes) -> None:
    exchange(base, "POST", "/api/generate", content)


@FUZZ
@given(content=body(CHAT, CHAT_ABSURD))
def test_chat(base: str, content: bytes) -> None:
    exchange(base, "POST", "/api/chat", content)


@FUZZ
@given(content=body(SHOW))
def test_show(base: str, content: bytes) -> None:
    exchange(base, "POST", "/api/show", content)


@FUZZ
@given(content=body(PULL))
def test_pull(base: str, content: bytes) -> None:
    """The hub is unreachable (HF_HUB_OFFLINE): every pull fails, as a 4xx or an error line."""
    exchange(base, "POST", "/api/pull", content)


@FUZZ
@given(content=body(COPY))
def test_copy(base: str, content: bytes) -> None:
    exchange(base, "POST", "/api/copy", content)


@FUZZ
@given(content=body(DELETE))
def test_delete(base: str, content: bytes) -> None:
    exchange(base, "DELETE", "/api/delete", content)


@FUZZ
@given(content=body(V1_CHAT, V1_CHAT_ABSURD))
def test_v1_chat_completions(base: str, content: bytes) -> None:
    exchange(base, "POST", "/v1/chat/completions", content)


@FUZZ
@given(content=body(V1_COMPLETIONS, V1_COMPLETIONS_ABSURD))
def test_v1_completions(base: str, content: bytes) -> None:
    exchange(base, "POST", "/v1/completions", content)


QUERY = st.dictionaries(st.text(max_size=6), st.text(max_size=12), max_size=3)


@FUZZ
@given(
    path=st.sampled_from(["/api/ps", "/api/tags", "/v1/models", "/api/version", "/api/mlxd/stats"]),
    query=QUERY,
    content=st.one_of(body(st.dictionaries(st.text(max_size=6), WILD, max_size=3)), st.just(b"")),
)
def test_listings(base: str, path: str, query: dict[str, str], content: bytes) -> None:
    """GET routes ignore bodies and query strings."""
    exchange(base, "GET", f"{path}?{urllib.parse.urlencode(query)}", content)


@FUZZ
@given(name=st.one_of(MODEL.filter(lambda m: isinstance(m, str)), st.text(max_size=40)))
def test_v1_model(base: str, name: str) -> None:
    exchange(base, "GET", "/v1/models/" + urllib.parse.quote(name, safe=""), b"")


@pytest.mark.parametrize(
    "route", ["/api/generate", "/api/chat", "/v1/chat/completions", "/v1/completions"]
)
def test_serves_after_fuzzing(base: str, route: str) -> None:
    """Whatever came before, a plain request to the served model still generates."""
    chat = [{"role": "user", "content": "hi"}]
    bodies: dict[str, dict[str, Any]] = {
        "/api/generate": {"prompt": "hi", "stream": False, "options": {"num_predict": 3}},
        "/api/chat": {"messages": chat, "stream": False, "options": {"num_predict": 3}},
        "/v1/chat/completions": {"messages": chat, "max_tokens": 3},
        "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    }
    r = httpx.post(f"{base}{route}", json={"model": "tiny", **bodies[route]}, timeout=120)
    assert r.status_code == 200, r.text
