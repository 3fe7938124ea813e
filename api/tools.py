"""Tool calls parsed out of a model's streamed text, in the format its chat template taught it.

One incremental parser serves every family; a family is its markers:

- hermes (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number, anywhere in the answer;
- llama3 (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (several
  joined by `;`), optionally after `<|python_tag|>`;
- mistral: `[TOOL_CALLS]` then a JSON array of calls (or v11's `name[ARGS]{...}`), to the end;
- json (a template that takes tools but names no format): an answer that is a JSON object.

Text around calls stays content. A tail that could be the start of a marker is held back, so a
call never leaks as content; a call that does not parse, or names a tool the request did not
declare, is given back as the text it was (never an error).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxd.api.chatformat import GRANITE, HERMES, JSON, LLAMA3, MISTRAL, QWEN_XML
from mlxd.api.errors import ApiError
from mlxd.api.thinking import CONTENT, Piece, partial_tail

_ID_CHARS = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: arguments are an object, in the order the model wrote them."""

    name: str
    arguments: dict[str, Any]
    index: int = 0
    id: str = ""


def call_id() -> str:
    """Ollama's ids: `call_` and 8 random characters."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(8))


def tool_params(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """Each declared function's parameter schemas by name (what a call's text values convert
    to); tools are assumed checked (`tool_names`)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool["function"]
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def tool_names(tools: Sequence[Any] | None) -> set[str]:
    """The declared functions' names; a tool that is not an object naming a function is a 400."""
    names = set()
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, "invalid tools: each tool needs a function with a name")
        names.add(name)
    return names


@dataclass(frozen=True)
class Markers:
    start: str | None  # opens a call mid-answer
    end: str | None  # closes it; None: the call runs to the end of the answer
    leading_json: bool  # an answer whose first character is `{` or `[` is a call


MARKERS = {
    HERMES: Markers("<tool_call>", "</tool_call>", False),
    QWEN_XML: Markers("<tool_call>", "</tool_call>", False),
    LLAMA3: Markers("<|python_tag|>", None, True),
    MISTRAL: Markers("[TOOL_CALLS]", None, False),
    GRANITE: Markers("<|tool_call|>", None, False),
    JSON: Markers(None, None, True),
}


def _decode_args(value: Any) -> dict[str, Any] | None:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _objects(text: str) -> list[Any] | None:
    """The JSON values in `text`: one value, or several separated by `;` or whitespace."""
    decoder = json.JSONDecoder()
    out, pos, text = [], 0, text.strip()
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        out.extend(value if isinstance(value, list) else [value])
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return out


_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*\[ARGS\]")


def _in_string(body: str) -> bool:
    """Whether a JSON call body ends inside a string (its quotes not all closed)."""
    if not body.lstrip().startswith(("{", "[")):
        return False  # XML calls, whose values are raw text
    inside, escaped = False, False
    for ch in body:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = inside
        elif ch == '"':
            inside = not inside
    return inside


def _mistral_v11(text: str) -> list[Any] | None:
    """`name[ARGS]{...}` repeated, `[TOOL_CALLS]` between calls (the first one already
    removed); read call by call, so a marker inside an argument's string stays text."""
    out: list[Any] = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        m = _MISTRAL_V11.match(text, pos)
        if not m:
            return None
        try:
            args, pos = decoder.raw_decode(text, m.end())
        except ValueError:
            return None
        out.append({"name": m.group(1), "arguments": args})
        rest = text[pos:].lstrip()
        if not rest:
            return out
        if not rest.startswith("[TOOL_CALLS]"):
            return None
        pos = len(text) - len(rest) + len("[TOOL_CALLS]")


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter schema names (`type`, a list of them, or `anyOf` branches)."""
    if not isinstance(schema, dict):
        return set()
    named = schema.get("type")
    types = {named} if isinstance(named, str) else {t for t in named or () if isinstance(t, str)}
    for branch in schema.get("anyOf") or schema.get("oneOf") or ():
        types |= _types(branch)
    return types


_JSON_TYPES = {int: {"integer", "number"}, float: {"number"}, dict: {"object"}, list: {"array"}}


def _typed(raw: str, schema: Any) -> Any:
    """An XML call's parameter text as its schema's type, as Ollama's and vLLM's Qwen3-Coder
    parsers convert it: a string parameter stays text ("2024" is not a number), an integer,
    number, boolean, object or array is read as one where the text is one; a parameter of no
    known type is text."""
    types, text = _types(schema), raw.strip()
    if "null" in types and text.lower() == "null":
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        return raw
    return value if types & _JSON_TYPES.get(type(value), set()) else raw


def _xml_calls(body: str, params: Mapping[str, Mapping[str, Any]]) -> list[Any] | None:
    """Qwen3-Coder's `<function=f><parameter=p>value</parameter></function>`, each value
    converted by its tool's schema (`_typed`)."""
    calls = []
    for fn in _XML_FUNCTION.finditer(body):
        schemas = params.get(fn.group(1), {})
        args = {
            param.group(1): _typed(param.group(2), schemas.get(param.group(1)))
            for param in _XML_PARAMETER.finditer(fn.group(2))
        }
        calls.append({"name": fn.group(1), "arguments": args})
    leftover = _XML_FUNCTION.sub("", body).strip()
    return calls if calls and not leftover else None


def parse_calls(
    body: str, names: set[str], params: Mapping[str, Mapping[str, Any]] | None = None
) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls in a call body, or None when it is not calls to declared tools. A body that
    opens with `<function=` is Qwen3-Coder's XML (`params`: the tools' parameter schemas its
    text values convert by); JSON otherwise, whose strings may hold `<function=` too."""
    xml = body.lstrip().startswith("<function=")
    items = _xml_calls(body, params or {}) if xml else _objects(body)
    if items is None and "[ARGS]" in body:
        items = _mistral_v11(body)
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        if isinstance(item.get("function"), dict):  # {"type": "function", "function": {...}}
            item = item["function"]
        name = item.get("name")
        args = _decode_args(item.get("arguments", item.get("parameters")))
        if not isinstance(name, str) or name not in names or args is None:
            return None
        calls.append((name, args))
    return calls


class ToolCallParser:
    """Feeds output text through, returning content pieces and parsed calls in order."""

    def __init__(self, fmt: str, tools: Sequence[Any] | None) -> None:
        self.markers = MARKERS[fmt]
        self.names = tool_names(tools)
        self.params = tool_params(tools)
        self._state = "begin" if self.markers.leading_json else "text"  # | text | call
        self._held = ""  # text not yet given out
        self._opener = ""  # the marker that opened the current call
        self.count = 0  # calls given out so far

    def feed(self, text: str) -> list[Piece | ToolCall]:
        out: list[Piece | ToolCall] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "begin":
                stripped = text.lstrip()
                start = self.markers.start
                if not stripped or (start and start.startswith(stripped) and start != stripped):
                    self._held = text
                    return out
                if stripped[0] in "{[":
                    self._state, self._opener = "call", ""
                    self._held = stripped
                    return out
                self._state = "text"
                continue
            if self._state == "text":
                start = self.markers.start
                at = text.find(start) if start else -1
                if at < 0:
                    keep = partial_tail(text, start) if start else 0
                    if len(text) > keep:
                        out.append(Piece(CONTENT, text[: len(text) - keep]))
                    self._held = text[len(text) - keep :]
                    return out
                assert start is not None
                if at:
                    out.append(Piece(CONTENT, text[:at]))
                self._state, self._opener = "call", start
                text = text[at + len(start) :]
                continue
            # call: buffered until its end marker, or the end of the answer; a marker inside
            # a JSON string (an argument holding code) does not end the call
            end = self.markers.end
            at = text.find(end) if end else -1
            while at >= 0 and end is not None and _in_string(text[:at]):
                at = text.find(end, at + len(end))
            if at < 0:
                self._held = text
                return out
            assert end is not None
            out.extend(self._close(text[:at], end))
            self._state = "text"
            text = text[at + len(end) :]
        return out

    def _close(self, body: str, closer: str) -> list[Piece | ToolCall]:
        calls = parse_calls(body, self.names, self.params)
        if calls is None:
            return [Piece(CONTENT, self._opener + body + closer)]
        out: list[Piece | ToolCall] = []
        for name, args in calls:
            out.append(ToolCall(name, args, self.count, call_id()))
            self.count += 1
        return out

    def finish(self) -> list[Piece | ToolCall]:
        held, self._held = self._held, ""
        if self._state == "call":
            end = self.markers.end
            at = held.find(end) if end else -1
            if at >= 0 and end is not None:  # a quote the call never closed held its end
                out = self._close(held[:at], end)  # marker as string text: it ends it after all
                self._state = "text"
                return out + self.feed(held[at + len(end) :]) + self.finish()
            return self._close(held, "")
        return [Piece(CONTENT, held)] if held else []


def template_calls(calls: Any, mistral: bool) -> list[dict[str, Any]]:
    """An assistant message's calls as HF templates read them: `function.arguments` an
    object, a `type`, and (for Mistral's templates) 9-character alphanumeric ids."""
    out = []
    for i, call in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(call, Mapping):
            raise ApiError(400, "invalid message format: a tool call must be an object")
        inner = call.get("function")
        fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else call
        args = _decode_args(fn.get("arguments"))
        if args is None:
            raise ApiError(400, "invalid tool call arguments")
        ident = str(call.get("id") or "")
        if mistral:
            ident = mistral_id(ident or f"call{i}")
        shaped: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn.get("name"), "arguments": args},
        }
        if ident:
            shaped["id"] = ident
        out.append(shaped)
    return out


def mistral_id(ident: str) -> str:
    """Mistral's templates refuse ids that are not 9 alphanumeric characters; others map to
    one stably, so a tool result still names its call."""
    if len(ident) == 9 and ident.isalnum():
        return ident
    digest = hashlib.sha256(ident.encode()).hexdigest()
    return digest[:9]
