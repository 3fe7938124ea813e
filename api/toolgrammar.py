"""Tool calls constrained by a grammar, in the model's own format.

A Lark grammar (llguidance) per request, built from the declared tools:

- `auto`: free text, and wherever the model opens a call (its marker token: `<tool_call>`,
  `[TOOL_CALLS]`, `<|tool_call|>`) the call must name a declared tool and its arguments must match that tool's
  JSON schema, so they always parse;
- `required`: the reply is calls, one or more (after an optional think block);
- a named function: the reply is one call of that function.

The call text is exactly what the family's template renders in history (`{"name": "f",
"arguments": {...}}` for Qwen, `"parameters"` for Llama), so a forced call stays in the
model's own distribution. Marker tokens are named by id (`<[id]>`): they are special tokens,
which never match as text. Formats without a marker token (Llama's bare JSON, the generic
JSON fallback) are constrained only when a call is required; gpt-oss's channels and
Qwen3-Coder's XML calls are not constrained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mlxd.api.chatformat import GRANITE, HERMES, JSON, LLAMA3, MISTRAL, ChatFormat
from mlxd.engine.grammar import (
    ANY_OBJECT,
    JSON_LAYOUT,
    GrammarError,
    GrammarSpec,
    closed,
    validate,
)

AUTO, REQUIRED = "auto", "required"
TEXT = "TEXT: /(.|\\n)*/"
# between the parts a grammar forces (after the reasoning, between calls): a few characters,
# so a model that would rather not call cannot fill the reply with whitespace until the limit
WS = "/[ \\t\\n]{0,8}/"


def _token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _token(tokenizer: Any, text: str) -> str:
    """A marker as a grammar item: its token by id when it is one token, else its text."""
    token = _token_id(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def with_layout(schema: dict[str, Any]) -> str:
    """`schema`'s JSON with mlxd's layout, under any `x-guidance` options it sets itself."""
    own = schema.get("x-guidance")
    return json.dumps(
        {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}
    )


def _schema(tool: dict[str, Any]) -> str:
    """The tool's parameters as its call's arguments must match them; a schema llguidance
    cannot compile (`uniqueItems`, `not`) leaves that tool's arguments any JSON object, as
    Ollama constrains none: one tool's schema never refuses the request."""
    params = tool["function"].get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object"}
    try:
        validate(GrammarSpec.schema(params))
    except GrammarError:
        params = json.loads(ANY_OBJECT)
    return with_layout(closed(params))


def _body(tool: dict[str, Any], key: str) -> str:
    """`{"name": "f", "<key>": <arguments>}` with the arguments held to the tool's schema."""
    head = json.dumps(f'{{"name": {json.dumps(tool["function"]["name"])}, "{key}": ')
    return f'{head} %json {_schema(tool)} "}}"'


def _think(fmt: ChatFormat, tokenizer: Any, opens_thinking: bool) -> tuple[str, list[str]]:
    """The start rule's think block (its prefix and rule) for a model that thinks first:
    required where the prompt opened it, else optional. The reasoning runs free: any token
    but the one closing it and end of sequence, special ones too (a model drafting a
    `<tool_call>` while it thinks writes its marker token, which text does not match)."""
    if fmt.think is None:
        return "", []
    start, end = _token(tokenizer, fmt.think.open), _token(tokenizer, fmt.think.close)
    close = _token_id(tokenizer, fmt.think.close)
    body = "TEXT"
    if close is not None:
        barred = sorted({close, *getattr(tokenizer, "eos_token_ids", ())})
        body = f"<[^{','.join(map(str, barred))}]>*"
    opener = "" if opens_thinking else f"{start} "
    prefix = "think " if opens_thinking else "think? "
    return prefix, [f"think: {opener}{body} {end} {WS}"]


def after_thinking(
    spec: GrammarSpec, fmt: ChatFormat, tokenizer: Any, thinking: bool, opens_thinking: bool
) -> GrammarSpec:
    """A JSON `format` (or `response_format`) for a reply that thinks first: the reasoning
    runs free and the answer after it keeps to the format, as Ollama applies a format once
    thinking ends (held from the first token, the JSON would land in the thinking, or the
    model would never think). Other grammars, and replies without thinking: `spec`."""
    if not thinking or fmt.think is None or spec.kind not in ("json", "json_schema"):
        return spec
    body = with_layout(json.loads(ANY_OBJECT if spec.kind == "json" else spec.source))
    prefix, rules = _think(fmt, tokenizer, opens_thinking)
    lines = ["%llguidance {}", f"start: {prefix}{WS} %json {body}", *rules, TEXT]
    return GrammarSpec("lark", "\n".join(lines))


def tool_grammar(
    fmt: ChatFormat,
    tokenizer: Any,
    tools: Sequence[dict[str, Any]],
    choice: str,
    opens_thinking: bool,
) -> GrammarSpec | None:
    """The grammar for `choice` (AUTO, REQUIRED, or a function name whose tool is the only one
    in `tools`), or None where the format is left unconstrained."""
    if not tools or fmt.harmony or fmt.tools is None:
        return None
    forced = choice != AUTO
    key = "parameters" if fmt.tools == LLAMA3 else "arguments"
    bodies = " | ".join(f"call_{i}" for i in range(len(tools)))
    rules = [f"call_{i}: {_body(tool, key)}" for i, tool in enumerate(tools)]
    think, rule = _think(fmt, tokenizer, opens_thinking)
    rules += rule
    many = "+" if choice == REQUIRED else ""

    if fmt.tools == HERMES:
        open_, close = _token(tokenizer, "<tool_call>"), _token(tokenizer, "</tool_call>")
        rules.append(f'call: {open_} "\\n" ({bodies}) "\\n" {close}')
        start = f"{think}(call {WS}){many}" if forced else f"{think}(TEXT call)* TEXT"
    elif fmt.tools == MISTRAL and fmt.named_calls:  # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated
        marker, args = _token(tokenizer, "[TOOL_CALLS]"), _token(tokenizer, "[ARGS]")
        rules = [
            f"call_{i}: {json.dumps(tool['function']['name'])} {args} %json {_schema(tool)}"
            for i, tool in enumerate(tools)
        ] + rule
        rules.append(f"call: {marker} ({bodies})")
        start = f"{think}call{many}" if forced else f"{think}TEXT call*"
    elif fmt.tools in (MISTRAL, GRANITE):  # the marker, then a JSON array of calls
        marker = _token(tokenizer, "[TOOL_CALLS]" if fmt.tools == MISTRAL else "<|tool_call|>")
        more = f' (", " ({bodies}))*' if many or not forced else ""
        rules.append(f'calls: {marker} " "? "[" ({bodies}){more} "]"')
        start = f"{think}calls" if forced else f"{think}TEXT calls?"
    elif fmt.tools in (LLAMA3, JSON):
        if not forced:
            return None
        tag = f"{_token(tokenizer, '<|python_tag|>')}? " if fmt.tools == LLAMA3 else ""
        sep = '"; "' if fmt.tools == LLAMA3 else WS
        rest = f" ({sep} ({bodies}))*" if many else ""
        start = f"{think}{tag}({bodies}){rest}"
    else:
        return None
    return GrammarSpec("lark", "\n".join(["%llguidance {}", f"start: {start}", *rules, TEXT]))
