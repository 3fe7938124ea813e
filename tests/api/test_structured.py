"""Structured outputs through real clients against a real server: Ollama's `format`, OpenAI's
`response_format` (and the SDK's `parse`), LangChain's `with_structured_output`, mlxd's
`options.grammar`; every output validated against its schema, and clear 400s for bad ones.

The tiny random models write nonsense, so the schemas bound their strings, numbers and arrays:
what is checked is that every output follows its schema and ends because the grammar did."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from mlxd.engine.grammar import closed
from tests.conftest import RunningServer


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Person(Strict):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=130)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pixel(Strict):
    x: int = Field(ge=0, le=4096)
    y: int = Field(ge=0, le=4096)
    color: Color


class Address(Strict):
    street: str = Field(max_length=16)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(Strict):
    person: Person
    address: Address
    vip: bool


class Order(Strict):
    id: int = Field(ge=1, le=99999)
    items: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)
    total: float = Field(ge=0, le=1000)


class Reading(Strict):
    sensor: Literal["temp", "humidity", "pressure"]
    values: list[int] = Field(min_length=1, max_length=4)


class Flags(Strict):
    a: bool
    b: bool
    c: Literal[1, 2, 3]


class Tree(Strict):
    label: str = Field(max_length=6)
    children: list[Person] = Field(max_length=2)


class Event(Strict):
    kind: Literal["click", "view"]
    at: int = Field(ge=0, le=86400)
    meta: Pixel | None


class Matrix(Strict):
    rows: list[Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(max_length=3)]] = Field(
        max_length=2
    )


class Review(Strict):
    stars: int = Field(ge=1, le=5)
    summary: str = Field(max_length=20)
    tags: list[Literal["good", "bad", "meh"]] = Field(max_length=3)


MODELS: list[type[BaseModel]] = [
    Person, Pixel, Customer, Order, Reading, Flags, Tree, Event, Matrix, Review,
]  # fmt: skip
NUM_PREDICT = 400


def check(schema: dict[str, Any], text: str) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, closed(schema))
    return value


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="ollama", max_retries=0)


# -- Ollama's format -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["generate", "chat"])
def test_ollama_client_format_schemas(client: ollama.Client, route: str, stream: bool) -> None:
    """10 schemas x 2 routes x streaming and not: 40 requests, alternating a plain model and a
    draft pairing, greedy and sampled."""
    for i, model_cls in enumerate(MODELS):
        schema = model_cls.model_json_schema()
        model = "pair" if i % 2 else "tiny"
        options = {"temperature": 0.7 * (i % 3 == 0), "seed": i, "num_predict": NUM_PREDICT}
        prompt = f"Describe a {model_cls.__name__} as JSON."
        if route == "generate":
            parts = client.generate(model, prompt, format=schema, options=options, stream=stream)
            chunks = list(parts) if stream else [parts]
            text = "".join(c.response for c in chunks)
        else:
            messages = [{"role": "user", "content": prompt}]
            parts = client.chat(model, messages, format=schema, options=options, stream=stream)
            chunks = list(parts) if stream else [parts]
            text = "".join(c.message.content or "" for c in chunks)
        final = chunks[-1]
        assert final.done and final.done_reason == "stop", (model_cls.__name__, text)
        check(schema, text)
        model_cls.model_validate_json(text)


def test_format_json_gives_an_object(client: ollama.Client) -> None:
    for model in ("tiny", "pair"):
        out = client.generate(model, "A JSON object:", format="json", options={"temperature": 0})
        assert isinstance(json.loads(out.response), dict) and out.done_reason == "stop"


def test_num_predict_first_ends_with_length(client: ollama.Client) -> None:
    schema = Customer.model_json_schema()
    whole = client.generate("pair", "x", format=schema, options={"temperature": 0})
    cut = client.generate("pair", "x", format=schema, options={"temperature": 0, "num_predict": 6})
    assert cut.done_reason == "length" and cut.eval_count == 6
    assert whole.response.startswith(cut.response) and whole.done_reason == "stop"


def test_concurrent_rows_each_keep_their_schema(client: ollama.Client) -> None:
    """Requests in flight together decode as rows of one batch, each with its own matcher."""

    def one(i: int) -> tuple[type[BaseModel], Any]:
        cls = MODELS[i % len(MODELS)]
        opts = {"temperature": 0.5, "seed": i, "num_predict": NUM_PREDICT}
        return cls, client.generate(
            "pair", f"item {i}", format=cls.model_json_schema(), options=opts
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(12)))
    for cls, out in results:
        assert out.done_reason == "stop", (cls.__name__, out.response)
        check(cls.model_json_schema(), out.response)


def test_options_grammar_regex_and_lark(server: RunningServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for grammar, pattern in [
            ({"regex": r"(yes|no), [0-9]{2}"}, r"(yes|no), [0-9]{2}"),
            ('start: "f(" NUM ")"\nNUM: /[0-9]{1,3}/', r"f\([0-9]{1,3}\)"),
            (
                {"lark": 'start: "[" W ("," W)* "]"\nW: /[a-z]{1,3}/'},
                r"\[[a-z]{1,3}(,[a-z]{1,3})*\]",
            ),
        ]:
            body = {"model": "pair", "prompt": "x", "stream": False,
                    "options": {"grammar": grammar, "temperature": 0, "num_predict": 60}}  # fmt: skip
            out = http.post("/api/generate", json=body).json()
            assert re.fullmatch(pattern, out["response"]), out
            assert out["done_reason"] == "stop"


# -- OpenAI's response_format ------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format_json_schema(oai: openai.OpenAI, stream: bool) -> None:
    for i, cls in enumerate(MODELS[:6]):
        schema = cls.model_json_schema()
        fmt: Any = {"type": "json_schema", "json_schema": {"name": cls.__name__, "schema": schema}}
        args: dict[str, Any] = dict(
            model="pair" if i % 2 else "tiny", max_tokens=NUM_PREDICT, seed=i, temperature=0.3,
            messages=[{"role": "user", "content": f"A {cls.__name__}"}], response_format=fmt,
        )  # fmt: skip
        if stream:
            chunks = list(oai.chat.completions.create(**args, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            out = oai.chat.completions.create(**args)
            text, finish = out.choices[0].message.content or "", out.choices[0].finish_reason
        assert finish == "stop"
        check(schema, text)


def test_openai_sdk_parse(oai: openai.OpenAI) -> None:
    for i, cls in enumerate(MODELS[:5]):
        out = oai.chat.completions.parse(
            model="pair", messages=[{"role": "user", "content": "fill it"}],
            response_format=cls, max_tokens=NUM_PREDICT, temperature=0, seed=i,
        )  # fmt: skip
        parsed = out.choices[0].message.parsed
        assert isinstance(parsed, cls)


def test_openai_json_object_and_completions(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_object"}, temperature=0,
    )  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    for cls in (Pixel, Review):
        schema = cls.model_json_schema()
        done = oai.completions.create(
            model="pair", prompt="JSON:", max_tokens=NUM_PREDICT, temperature=0,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
        )  # fmt: skip
        assert done.choices[0].finish_reason == "stop"
        check(schema, done.choices[0].text)


# -- LangChain --------------------------------------------------------------------------------


def test_langchain_with_structured_output(server: RunningServer) -> None:
    from langchain_ollama import ChatOllama

    for i, cls in enumerate(MODELS[:4]):
        llm = ChatOllama(
            model="pair", base_url=server.base_url, temperature=0, num_predict=NUM_PREDICT, seed=i
        )
        structured = llm.with_structured_output(cls, method="json_schema")
        assert isinstance(structured.invoke(f"Make a {cls.__name__}"), cls)


# -- bad requests ------------------------------------------------------------------------------

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "wat"}}}
# valid, but no finite output satisfies it: llguidance's parser gives up at the first token
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
WIDE = "start: " + " | ".join(f'"w{i}"' for i in range(5000))  # wider than the parser allows


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/api/generate", {"prompt": "x", "format": BAD_SCHEMA}, "invalid json schema: Invalid type: wat"),
        ("/api/generate", {"prompt": "x", "format": {"type": "array", "uniqueItems": True}, "stream": True}, "uniqueItems"),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "format": {"not": {}}}, '"not"'),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "format": {"$ref": "#/$defs/X"}, "stream": True}, "/$defs/X"),
        ("/api/generate", {"prompt": "x", "format": 5}, "invalid format: 5"),
        ("/api/generate", {"prompt": "x", "format": "json", "options": {"grammar": "start: /a/"}}, "conflicting"),
        ("/api/generate", {"prompt": "x", "options": {"grammar": 5}}, 'invalid option "grammar"'),
        ("/api/generate", {"prompt": "x", "options": {"grammar": {"regex": "[a-"}}}, "invalid regex"),
        ("/api/generate", {"prompt": "x", "options": {"grammar": "start: nothing_here"}}, "nothing_here"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "format": "json"}, "conflicting"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 'invalid response_format type: "xml"'),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "needs a 'schema' object"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}}, "Invalid type: wat"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "if": {}}}}}, '"if"'),
        ("/api/generate", {"prompt": "x", "format": ENDLESS, "stream": True}, "Too many items"),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "options": {"grammar": WIDE}}, "items"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"schema": ENDLESS}}}, "Too many items"),
    ],
)  # fmt: skip
def test_bad_structured_requests_are_400s(
    server: RunningServer, path: str, body: dict[str, Any], message: str
) -> None:
    response = httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    text = error if isinstance(error, str) else error["message"]
    assert message in text, text


# a first letter, then a rule wider than the parser allows: compiles, fails at the second token
FAILS_LATER = "start: /[a-z]/ wide\nwide: " + " | ".join(f'"w{i}"' for i in range(5000))


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_while_generating_is_the_requests_error(
    server: RunningServer, stream: bool
) -> None:
    """Not a 500: answered whole, a 400 naming the parser's limit (its state dump left out);
    streamed, an error line ends the stream. Requests running beside it are untouched (the
    engine's tests pin that), and the server serves the next request."""
    body = {"model": "tiny", "prompt": "x", "stream": stream,
            "options": {"grammar": FAILS_LATER, "temperature": 0, "num_predict": 8}}  # fmt: skip
    response = httpx.post(f"{server.base_url}/api/generate", json=body, timeout=60)
    if stream:
        assert response.status_code == 200
        last = json.loads(response.text.strip().splitlines()[-1])
        error = last["error"]
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert "grammar failed" in error and "items" in error and "<state>" not in error
    after = httpx.post(f"{server.base_url}/api/generate", json={"model": "tiny", "prompt": "x",
                       "stream": False, "options": {"num_predict": 2}}, timeout=60)  # fmt: skip
    assert after.status_code == 200
