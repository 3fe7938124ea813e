"""Bytes to structs and back: bounded body reading, typed decoding, fast encoding.

Decoding is the one path where a request's bytes become values, so it is where every malformed
input stops: a body over the size limit is a 413 before it is read whole; bad JSON, a lone
surrogate, nesting too deep, an integer too big or a field of the wrong type is an
`InvalidRequest` (400) naming the field. Per-token chunks are encoded by one reused msgspec
encoder: streaming pays for no dict building and no `json.dumps`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mlxd.api.errors import BodyTooLarge, InvalidRequest

T = TypeVar("T")

JSON = "application/json"
NDJSON = "application/x-ndjson"

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_MISMATCH = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`(?: - at `\$(?P<at>.*)`)?")
_AT = re.compile(r" - at `\$(?P<at>.*)`$")
_KINDS = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "array": "array",
    "object": "object",
}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it is known to exceed `limit`: from Content-Length
    before reading, or while a chunked body arrives."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise InvalidRequest("invalid Content-Length")
        if int(declared) > limit:
            raise BodyTooLarge(_too_large(limit))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(_too_large(limit))
    return bytes(body)


def _too_large(limit: int) -> str:
    return f"request body too large (the limit is {limit} bytes; see MLXD_MAX_BODY)"


def decode(raw: bytes, kind: type[T]) -> T:
    """`raw` as a `kind` struct; any failure is an InvalidRequest whose message names the field."""
    if not raw.strip():
        raise InvalidRequest("missing request body")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        value: T = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(describe(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("invalid JSON: nested too deeply") from exc
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from exc
    return value


async def read_request(request: Request, kind: type[T], limit: int) -> T:
    return decode(await read_body(request, limit), kind)


def describe(exc: msgspec.ValidationError) -> str:
    """msgspec's account of a mismatch in the words Ollama's errors use."""
    text = str(exc)
    m = _MISMATCH.fullmatch(text)
    if m is not None:
        at = (m.group("at") or "").lstrip(".")
        if not at:
            return "request body must be a JSON object"
        kinds = [k for k in m.group("want").split(" | ") if k != "null"]
        want = " or ".join(_KINDS.get(k, k) for k in kinds)
        return f"invalid value for field '{at}': expected {want}"
    at_match = _AT.search(text)
    if at_match is not None:
        problem = text[: at_match.start()].lower()
        return f"invalid value for field '{at_match.group('at').lstrip('.')}': {problem}"
    return f"invalid request: {text}"


# -- encoding -----------------------------------------------------------------------------------


# Characters JSON allows raw inside strings (and msgspec writes raw) that httpx's `iter_lines`,
# which ollama-python and LiteLLM read streams with, and Python's `str.splitlines` take for line
# breaks: a generated U+2028 would cut an NDJSON line in two. Written escaped, as Go's encoder
# writes U+2028 and U+2029; in valid UTF-8 these byte runs are only ever these characters.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def encode(obj: Any) -> bytes:
    """JSON, with no character a line reader could split on."""
    out = _encoder.encode(obj)
    if b"\xc2\x85" in out or b"\xe2\x80" in out:
        for raw, escaped in _LINE_BREAKS:
            out = out.replace(raw, escaped)
    return out


def ndjson_line(obj: Any) -> bytes:
    """One NDJSON line (Ollama's streams)."""
    return encode(obj) + b"\n"


def sse_event(obj: Any) -> bytes:
    """One server-sent event (OpenAI's streams)."""
    return b"data: " + encode(obj) + b"\n\n"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=JSON)
