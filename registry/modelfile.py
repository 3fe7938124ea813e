"""Ollama's Modelfile: parsed into the fields of a create request, and written back out.

The commands mlxd understands are `FROM`, `DRAFT` (mlxd's: the speculative draft), `ADAPTER`,
`DRAFT_ADAPTER` (mlxd's: an adapter for the draft), `PARAMETER`, `SYSTEM`, `TEMPLATE`, `MESSAGE`
and `LICENSE` (one or more); values may be quoted, and `\"\"\"` opens a multi-line value, as in
Ollama. An adapter's path may be followed by `scale=<number>` (mlxd's: the scale that replaces
its trained one). Anything else is an error that names the line.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxd.registry.schema import KNOWN_OPTIONS, AdapterRef

__all__ = ["Modelfile", "ModelfileError", "parameter_value", "parse_modelfile", "render_modelfile"]

COMMANDS = (
    "from", "draft", "adapter", "draft_adapter", "parameter", "system", "template", "message",
    "license",
)  # fmt: skip
_SCALED = re.compile(r"^(?P<path>.*\S)\s+scale=(?P<scale>\S+)$")


class ModelfileError(ValueError):
    """A Modelfile that cannot be read; the message names the line."""


@dataclass
class Modelfile:
    """What a Modelfile asks for."""

    from_: str | None = None
    draft: str | None = None
    adapters: list[AdapterRef] = field(default_factory=list)
    draft_adapters: list[AdapterRef] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)


def _value(raw: str) -> str:
    raw = raw.strip()
    if len(raw) >= 6 and raw.startswith('"""') and raw.endswith('"""'):
        return raw[3:-3]
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        try:
            return str(json.loads(raw))
        except json.JSONDecodeError:
            return raw[1:-1]
    return raw


def parameter_value(name: str, raw: str) -> Any:
    """A parameter's text (a Modelfile's PARAMETER, the chat's `/set parameter`) as its
    option's type; ValueError says what is wrong with it."""
    kind = KNOWN_OPTIONS.get(name)
    if kind is None:
        raise ValueError(f"unknown parameter '{name}'")
    value = _value(raw)
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
    except ValueError:
        raise ValueError(f"invalid value for parameter '{name}': {value}") from None
    return value


def _parameter(name: str, raw: str, line: int) -> Any:
    try:
        return parameter_value(name, raw)
    except ValueError as exc:
        raise ModelfileError(f"line {line}: {exc}") from None


def _statements(text: str) -> list[tuple[int, str, str]]:
    """(line, command, rest) with multi-line `\"\"\"` values joined."""
    out: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        number = i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        rest = rest.strip()
        if '"""' in rest and rest.count('"""') == 1:
            parts = [rest]
            while i < len(lines):
                parts.append(lines[i])
                i += 1
                if '"""' in lines[i - 1]:
                    break
            else:
                raise ModelfileError(f'line {number}: unterminated """')
            rest = "\n".join(parts)
        out.append((number, command.lower(), rest))
    return out


def _check_text(rest: str, line: int) -> None:
    """A quoted value's escapes may spell a lone surrogate (`"\\ud800"`), which no file, prompt
    or tokenizer takes: refused here, as a JSON body holding one is."""
    try:
        _value(rest).encode("utf-8")
    except UnicodeEncodeError:
        raise ModelfileError(
            f"line {line}: the value is not valid text (a lone surrogate)"
        ) from None


def parse_modelfile(text: str) -> Modelfile:
    """Parse Modelfile text; raises ModelfileError."""
    spec = Modelfile()
    for line, command, rest in _statements(text):
        _check_text(rest, line)
        if command not in COMMANDS:
            raise ModelfileError(f"line {line}: unknown command '{command.upper()}'")
        if not rest:
            raise ModelfileError(f"line {line}: {command.upper()} needs a value")
        if command == "from":
            spec.from_ = _value(rest)
        elif command == "draft":
            spec.draft = _value(rest)
        elif command == "adapter":
            spec.adapters.append(_adapter(rest, line))
        elif command == "draft_adapter":
            spec.draft_adapters.append(_adapter(rest, line))
        elif command == "parameter":
            name, _, raw = rest.partition(" ")
            value = _parameter(name.strip(), raw, line)
            if KNOWN_OPTIONS[name.strip()] == "strings":
                spec.parameters.setdefault(name.strip(), []).append(value)
            else:
                spec.parameters[name.strip()] = value
        elif command == "system":
            spec.system = _value(rest)
        elif command == "template":
            spec.template = _value(rest)
        elif command == "message":
            role, _, content = rest.partition(" ")
            if role not in ("system", "user", "assistant"):
                raise ModelfileError(f"line {line}: MESSAGE role must be system, user or assistant")
            spec.messages.append({"role": role, "content": _value(content)})
        elif command == "license":
            spec.licenses.append(_value(rest))
    if spec.from_ is None:
        raise ModelfileError("no FROM line")
    return spec


def _adapter(rest: str, line: int) -> AdapterRef:
    """An adapter line's path and, where `scale=<number>` follows it, its scale."""
    text = rest.strip()
    if text.startswith('"') and not text.startswith('"""'):
        try:
            path, end = json.JSONDecoder().raw_decode(text)
        except json.JSONDecodeError:
            return AdapterRef(_value(rest))
        tail = text[end:].strip()
        if not tail:
            return AdapterRef(str(path))
        if not tail.startswith("scale="):
            raise ModelfileError(f"line {line}: unexpected {tail!r} after the adapter's path")
        return AdapterRef(str(path), _scale(tail.removeprefix("scale="), line))
    found = _SCALED.match(text)
    if found is None:
        return AdapterRef(_value(rest))
    return AdapterRef(_value(found["path"]), _scale(found["scale"], line))


def _scale(text: str, line: int) -> float:
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise ModelfileError(f"line {line}: an adapter's scale must be a finite number")
    return scale


def _path(path: str) -> str:
    """A path as a Modelfile line writes it: quoted (as JSON, which `_value` reads back) where
    it holds a space."""
    return json.dumps(path) if any(c.isspace() for c in path) else path


def _adapter_line(command: str, ref: AdapterRef) -> str:
    return f"{command} {_path(ref.ref)}" + ("" if ref.scale is None else f" scale={ref.scale!r}")


def _quote(text: str) -> str:
    return f'"""{text}"""'


def render_modelfile(
    from_: str,
    adapters: Sequence[AdapterRef],
    parameters: dict[str, Any],
    system: str | None,
    template: str | None,
    messages: list[dict[str, str]] | None = None,
    header: str = "",
    draft: str | None = None,
    licenses: Sequence[str] = (),
    draft_adapters: Sequence[AdapterRef] = (),
) -> str:
    """A Modelfile that creates the model again (what `/api/show` and `mlxd show --modelfile`
    print)."""
    lines = [header] if header else []
    lines.append(f"FROM {_path(from_)}")
    if draft:
        lines.append(f"DRAFT {_path(draft)}")
    lines += [_adapter_line("ADAPTER", a) for a in adapters]
    lines += [_adapter_line("DRAFT_ADAPTER", a) for a in draft_adapters]
    if template:
        lines.append(f"TEMPLATE {_quote(template)}")
    if system:
        lines.append(f"SYSTEM {_quote(system)}")
    for key, value in parameters.items():
        for v in value if isinstance(value, list | tuple) else [value]:
            lines.append(f"PARAMETER {key} {json.dumps(v)}")
    for m in messages or []:
        lines.append(f"MESSAGE {m['role']} {_quote(m['content'])}")
    lines += [f"LICENSE {_quote(text)}" for text in licenses]
    return "\n".join(lines) + "\n"
