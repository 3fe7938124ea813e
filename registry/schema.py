"""The ``models.yaml`` schema (version 1) and its loader.

A registry file maps Ollama model names to what should be served under them::

    version: 1
    models:
      qwen2.5-coder:7b:
        target: mlx-community/Qwen2.5-Coder-7B-Instruct-4bit   # hub repo id or a directory
        draft: mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit  # optional speculative draft
        draft_tokens: 3
        options: {temperature: 0.2, stop: ["<|im_end|>"]}
        system: You are a careful programmer.
        context_length: 32768
      coder-sql:                                               # a LoRA adapter on that base
        target: mlx-community/Qwen2.5-Coder-7B-Instruct-4bit
        adapters: [./adapters/sql]                             # or [{path: ..., scale: 8.0}]

The file is hand-edited, so every mistake is reported with the file, the line, the entry and
the key (``models.yaml:12: entry 'coder': key 'draft_tokens': expected a non-negative integer,
got 'many'``). To know lines the loader walks YAML's node graph (``yaml.compose``) instead of
the plain constructed dict, which forgets where things came from.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from mlxd.registry.bounds import BOUNDS, OptionsError, check_bound
from mlxd.registry.distributed import Distribution, check_distributed
from mlxd.registry.embedded import EMBEDDED_DIR
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.templates import loaded_template

__all__ = [
    "ENTRY_CHOICES",
    "ENTRY_KEYS",
    "KNOWN_OPTIONS",
    "OPTION_CHOICES",
    "SCHEMA_VERSION",
    "AdapterRef",
    "ModelEntry",
    "RegistryError",
    "check_option",
    "load_registry_file",
    "resolve_target",
]

SCHEMA_VERSION = 1
EMBEDDED_PREFIX = "embedded:"  # a model shipped inside the package (registry/embedded/...)

ENTRY_KEYS: tuple[str, ...] = (
    "target",
    "draft",
    "draft_tokens",
    "options",
    "system",
    "template",
    "context_length",
    "description",
    "adapters",
    "draft_adapters",
    "messages",
    "license",
    "modified_at",
    "kind",
    "pooling",
    "distributed",
)
# `kind`: what the model is served for (absent: detected from its files); `pooling`: how an
# embedding model pools its tokens when its files and mlxd's table do not say.
ENTRY_CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"kind": ("completion", "embedding"), "pooling": ("cls", "mean", "last")}
)
# What decides a loaded pairing: entries equal on these share one loaded base (adapters, options
# and the system prompt are per request).
LOAD_KEYS: tuple[str, ...] = (
    "target",
    "draft",
    "draft_tokens",
    "template",
    "context_length",
    "distributed",
    "kind",  # what is loaded (a generation pairing or an embedding model)
    "pooling",  # an embedding model's vectors
)

# Ollama's option names and their types (``ollama:api/types.go`` Options + Runner). Unknown
# names are rejected: in a hand-written file a typo such as ``temprature`` must not be ignored
# silently. The legacy keys are accepted because Ollama still accepts them.
KNOWN_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "num_ctx": "int",
        "num_predict": "int",
        "num_keep": "int",
        "seed": "int",
        "top_k": "int",
        "repeat_last_n": "int",
        "num_batch": "int",
        "num_gpu": "int",
        "main_gpu": "int",
        "num_thread": "int",
        "draft_num_predict": "int",
        "kv_bits": "int",
        "kv_group_size": "int",
        "quantized_kv_start": "int",
        "mirostat": "int",
        "temperature": "float",
        "top_p": "float",
        "min_p": "float",
        "typical_p": "float",
        "repeat_penalty": "float",
        "presence_penalty": "float",
        "frequency_penalty": "float",
        "tfs_z": "float",
        "mirostat_tau": "float",
        "mirostat_eta": "float",
        "use_mmap": "bool",
        "numa": "bool",
        "low_vram": "bool",
        "f16_kv": "bool",
        "logits_all": "bool",
        "vocab_only": "bool",
        "use_mlock": "bool",
        "embedding_only": "bool",
        "penalize_newline": "bool",
        "stop": "strings",
        "draft_method": "choice",  # mlxd's own: how to draft for speculative decoding
    }
)
OPTION_CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"draft_method": ("auto", "model", "lookup", "forced", "off")}
)

# Hugging Face repo ids: ``name`` or ``namespace/name``.
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class RegistryError(ValueError):
    """A registry file that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA/DoRA adapter: a hub repo id or a directory in mlx-lm's layout
    (`adapter_config.json` + `adapters.safetensors`), and a scale replacing the trained one."""

    ref: str
    scale: float | None = None

    @property
    def is_path(self) -> bool:
        return os.path.isabs(self.ref)


@dataclass(frozen=True)
class ModelEntry:
    """One served model: what to load for a name and the defaults that go with it."""

    name: str
    target: str
    draft: str | None = None
    draft_tokens: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    system: str | None = None
    template: str | None = None
    context_length: int | None = None
    description: str | None = None
    kind: str | None = None  # "completion" or "embedding"; None: detected from the files
    pooling: str | None = None  # "cls", "mean" or "last" (embedding models)
    adapters: tuple[AdapterRef, ...] = ()  # mounted on the target, selected per request
    draft_adapters: tuple[AdapterRef, ...] = ()  # mounted on the draft model
    messages: tuple[Mapping[str, str], ...] = field(default=(), hash=False)  # chats start so
    license: tuple[str, ...] = ()  # the license texts a create gave it (Ollama's LICENSE)
    modified_at: str | None = None  # RFC 3339: when a create or copy wrote the entry
    distributed: Distribution | None = None  # the target sharded over several processes
    # where it was read (for messages): not part of what the entry is, so a line moved by an
    # edit elsewhere in the file changes nothing served
    source: Path = field(default_factory=lambda: Path("<memory>"), compare=False)
    line: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Canonical name and a read-only copy of options, whoever builds the entry.
        object.__setattr__(self, "name", parse_name(self.name).display)
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def key(self) -> str:
        """The case-insensitive lookup key (``ModelName.key``)."""
        return self.name.lower()

    @property
    def load_key(self) -> tuple[Any, ...]:
        """What the loaded pairing depends on (`LOAD_KEYS`): equal keys share one load. Of the
        template, what the tokenizer is loaded with (`loaded_template`): entries differing only
        in an Ollama (Go) template, rendered per request, share one."""
        return tuple(
            loaded_template(self.template) if k == "template" else getattr(self, k)
            for k in LOAD_KEYS
        )

    @property
    def target_is_path(self) -> bool:
        """True when ``target`` is a local directory rather than a hub repo id."""
        return os.path.isabs(self.target)

    @property
    def draft_is_path(self) -> bool:
        """True when ``draft`` is a local directory rather than a hub repo id."""
        return self.draft is not None and os.path.isabs(self.draft)


def resolve_target(raw: str, base_dir: Path) -> str:
    """Turn a ``target``/``draft`` value into an absolute path or a hub repo id.

    Paths are recognised by shape (absolute, ``~``, ``./``, ``../``, backslashes, or more
    segments than a repo id can have); a repo-id-shaped value is a path only if that
    directory exists next to the registry file, so ``models/tiny`` works when present and
    ``mlx-community/X`` is a repo id otherwise.
    """
    if raw.startswith(EMBEDDED_PREFIX):
        return os.path.normpath(EMBEDDED_DIR / raw.removeprefix(EMBEDDED_PREFIX))
    if raw.startswith("~"):
        return os.path.normpath(os.path.expanduser(raw))
    if os.path.isabs(raw):
        return os.path.normpath(raw)
    candidate = os.path.normpath(os.path.join(base_dir, raw))
    first = raw.replace("\\", "/").split("/", 1)[0]
    if first in (".", "..") or "\\" in raw or not _REPO_ID_RE.fullmatch(raw):
        return candidate
    if os.path.isdir(candidate):
        return candidate
    return raw


def portable_ref(ref: str) -> str:
    """The form of a resolved ``target``/``draft`` to write into another registry file: a
    model shipped inside the package goes back to ``embedded:...``, so a copy names it rather
    than a path into one installation (a virtual environment that may move or be rebuilt)."""
    try:
        inside = Path(ref).resolve().relative_to(EMBEDDED_DIR.resolve())
    except (ValueError, OSError):
        return ref
    return EMBEDDED_PREFIX + inside.as_posix()


# --- loading -----------------------------------------------------------------------------


def _describe(value: Any) -> str:
    """Render a bad value for an error message, YAML-ish and short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _line(node: yaml.Node | None) -> int | None:
    return None if node is None else node.start_mark.line + 1


class _Context:
    """Where we are in the file, to build messages like ``f.yaml:3: entry 'x': key 'y': ...``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._constructor = yaml.SafeLoader("")

    def error(
        self,
        message: str,
        node: yaml.Node | None = None,
        entry: str | None = None,
        key: str | None = None,
    ) -> RegistryError:
        line = _line(node)
        where = f"{self.path}:{line}" if line is not None else str(self.path)
        parts = [where]
        if entry is not None:
            parts.append(f"entry {entry!r}")
        if key is not None:
            parts.append(f"key {key!r}")
        parts.append(message)
        return RegistryError(": ".join(parts))

    def value(self, node: yaml.Node, entry: str | None = None, key: str | None = None) -> Any:
        """Construct the plain Python value of a node (scalars, lists, mappings)."""
        try:
            return self._constructor.construct_document(node)
        except yaml.YAMLError as exc:
            raise self.error(f"invalid value: {exc}", node, entry, key) from exc

    def pairs(
        self,
        node: yaml.MappingNode,
        entry: str | None = None,
        prefix: str = "",
        check_duplicates: bool = True,
    ) -> list[tuple[str, yaml.Node, yaml.Node]]:
        """Key text, key node and value node of a mapping, with ``<<`` merges applied.

        PyYAML silently keeps the last of two equal keys; in a config file that hides a
        mistake, so duplicates are errors here (unless the caller checks them itself).
        """
        label = f"{prefix}*" if prefix else None
        own = {id(k) for k, _ in node.value}  # keys written here, not brought in by ``<<``
        try:
            self._constructor.flatten_mapping(node)
        except yaml.YAMLError as exc:
            raise self.error(f"invalid merge: {exc}", node, entry, label) from exc
        for knode, _ in node.value:
            if not isinstance(knode, yaml.ScalarNode) or knode.tag == "tag:yaml.org,2002:null":
                raise self.error("expected a plain string key", knode, entry, label)
        if not check_duplicates:
            return [(str(k.value), k, v) for k, v in node.value]
        found: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for knode, vnode in node.value:
            name = str(knode.value)
            first = found.get(name)
            if first is not None and id(first[0]) in own:
                raise self.error(
                    f"duplicate key (first on line {_line(first[0])})",
                    knode,
                    entry,
                    prefix + name,
                )
            # Merged keys come first after flattening, so a key written here overrides them.
            found.pop(name, None)
            found[name] = (knode, vnode)
        return [(name, k, v) for name, (k, v) in found.items()]


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _check_int(value: Any, minimum: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected {what}, got {_describe(value)}")
    return value


def _check_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    return value


def _check_choice(value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"expected one of {', '.join(choices)}, got {_describe(value)}")
    return str(value)


def check_option(name: str, value: Any) -> Any:
    """`value` of option `name` as written (a registry entry, a PARAMETER, `/set parameter`):
    its type, and a number within the range a request is held to (`bounds`), so a value every
    request would be refused for is refused where it is written."""
    kind = KNOWN_OPTIONS[name]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {_describe(value)}")
        _in_range(name, value)
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {_describe(value)}")
        _in_range(name, value)
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_describe(value)}")
        return value
    if kind == "choice":
        choices = OPTION_CHOICES[name]
        if value is False and "off" in choices:
            return "off"  # YAML 1.1 reads an unquoted `off` as false
        return _check_choice(value, choices)
    # "strings": one string or a list of strings, kept as an immutable tuple.
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"expected a string or a list of strings, got {_describe(value)}")


def _in_range(name: str, value: int | float) -> None:
    if name in BOUNDS:
        try:
            check_bound(name, value)
        except OptionsError as exc:
            raise ValueError(str(exc).removeprefix(f'option "{name}" ')) from None


def _load_options(ctx: _Context, node: yaml.Node, entry: str) -> dict[str, Any]:
    if _is_null(node):
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ctx.error(
            f"expected a mapping of option names to values, got {_describe(ctx.value(node))}",
            node,
            entry,
            "options",
        )
    options: dict[str, Any] = {}
    for name, knode, vnode in ctx.pairs(node, entry, "options."):
        if name not in KNOWN_OPTIONS:
            close = difflib.get_close_matches(name, list(KNOWN_OPTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ctx.error(f"unknown option{hint}", knode, entry, f"options.{name}")
        try:
            options[name] = check_option(name, ctx.value(vnode, entry, f"options.{name}"))
        except ValueError as exc:
            if isinstance(exc, RegistryError):
                raise
            raise ctx.error(str(exc), knode, entry, f"options.{name}") from None
    return options


def _load_entry(
    ctx: _Context, name: str, knode: yaml.Node, vnode: yaml.Node, base_dir: Path
) -> ModelEntry:
    if not isinstance(vnode, yaml.MappingNode):
        got = "nothing" if _is_null(vnode) else _describe(ctx.value(vnode, name))
        raise ctx.error(f"expected a mapping with at least 'target', got {got}", knode, name)

    fields: dict[str, Any] = {}
    checks: dict[str, Callable[[Any], Any]] = {
        "target": lambda v: _check_ref(v, base_dir),
        "draft": lambda v: _check_ref(v, base_dir),
        "draft_tokens": lambda v: _check_int(v, 0, "a non-negative integer"),
        "context_length": lambda v: _check_int(v, 1, "a positive integer"),
        "system": _check_str,
        "template": _check_str,
        "description": _check_str,
        "kind": lambda v: _check_choice(v, ENTRY_CHOICES["kind"]),
        "pooling": lambda v: _check_choice(v, ENTRY_CHOICES["pooling"]),
        "adapters": lambda v: _check_adapters(v, base_dir),
        "draft_adapters": lambda v: _check_adapters(v, base_dir),
        "messages": _check_messages,
        "license": _check_license,
        "modified_at": _check_time,
        "distributed": lambda v: check_distributed(v, base_dir),
    }
    for key, key_node, value_node in ctx.pairs(vnode, name):
        if key == "options":
            fields["options"] = _load_options(ctx, value_node, name)
            continue
        check = checks.get(key)
        if check is None:
            close = difflib.get_close_matches(key, ENTRY_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ctx.error(
                f"unknown key ({hint}expected one of: {', '.join(ENTRY_KEYS)})",
                key_node,
                name,
                key,
            )
        value = ctx.value(value_node, name, key)
        try:
            fields[key] = check(value)
        except ValueError as exc:
            if isinstance(exc, RegistryError):
                raise
            raise ctx.error(str(exc), key_node, name, key) from None

    if "target" not in fields:
        raise ctx.error("missing required key 'target'", knode, name)
    if "distributed" in fields and (fields.get("adapters") or fields.get("draft_adapters")):
        raise ctx.error("a distributed pairing cannot mount adapters", knode, name, "distributed")
    return ModelEntry(
        name=name,
        source=ctx.path,
        line=_line(knode),
        **fields,
    )


def _check_ref(value: Any, base_dir: Path) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a hub repo id or a directory path, got {_describe(value)}")
    return resolve_target(value.strip(), base_dir)


def _check_license(value: Any) -> tuple[str, ...]:
    """`license:` one text or a list of them."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"expected a license text or a list of them, got {_describe(value)}")
    return tuple(texts)


def rfc3339(dt: datetime) -> str:
    """A time as the API writes times (and `modified_at` is kept): UTC, microseconds, `Z`."""
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 time back (ValueError where it is none)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _check_time(value: Any) -> str:
    """An RFC 3339 time (`2026-12-05T07:30:00Z`); YAML may have read it as a datetime."""
    if isinstance(value, datetime):
        value = value.isoformat().replace("+00:00", "Z")
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            parse_rfc3339(value)
            return value
    raise ValueError(f"expected an RFC 3339 time, got {_describe(value)}")


def _check_messages(value: Any) -> tuple[Mapping[str, str], ...]:
    """`messages:` a list of `{role, content}` every chat starts with (Ollama's MESSAGE)."""
    if not isinstance(value, list):
        raise ValueError(f"expected a list of {{role, content}} messages, got {_describe(value)}")
    out = []
    for item in value:
        if (
            not isinstance(item, Mapping)
            or set(item) != {"role", "content"}
            or item["role"] not in ("system", "user", "assistant")
            or not isinstance(item["content"], str)
        ):
            raise ValueError(f"expected a {{role, content}} message, got {_describe(item)}")
        out.append(MappingProxyType({"role": item["role"], "content": item["content"]}))
    return tuple(out)


def _check_adapters(value: Any, base_dir: Path) -> tuple[AdapterRef, ...]:
    """`adapters:` is one reference, or a list of references and `{path, scale}` mappings."""
    items = value if isinstance(value, list) else [value]
    refs: list[AdapterRef] = []
    for item in items:
        if isinstance(item, Mapping):
            unknown = set(item) - {"path", "scale"}
            if unknown or "path" not in item:
                raise ValueError(
                    f"expected an adapter as a path or {{path, scale}}, got {_describe(item)}"
                )
            scale = item.get("scale")
            if scale is not None and (
                isinstance(scale, bool)
                or not isinstance(scale, (int, float))
                or not math.isfinite(scale)  # `.nan`, `.inf`: answers of nothing, or garbage
            ):
                raise ValueError(
                    f"expected a finite number for the adapter scale, got {_describe(scale)}"
                )
            refs.append(
                AdapterRef(
                    _check_ref(item["path"], base_dir), None if scale is None else float(scale)
                )
            )
        else:
            refs.append(AdapterRef(_check_ref(item, base_dir)))
    return tuple(refs)


def load_registry_file(path: Path) -> dict[str, ModelEntry]:
    """Load and validate one registry file, keyed by ``ModelName.key`` in file order.

    An empty (or comment-only) file and ``models:`` with nothing under it are valid and
    empty, so a user can keep a skeleton file around. Raises :class:`RegistryError`.
    """
    path = Path(path).expanduser().absolute()
    ctx = _Context(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ctx.error(f"not UTF-8 text ({exc.reason})") from exc
    except OSError as exc:
        raise ctx.error(f"cannot read registry file: {exc.strerror or exc}") from exc

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        if exc.context and exc.problem and exc.problem.startswith("but "):
            problem = f"{exc.context}, {exc.problem}"  # "expected X, but found Y"
        line = f":{mark.line + 1}" if mark is not None else ""
        raise RegistryError(f"{path}{line}: invalid YAML: {problem}") from exc
    except yaml.YAMLError as exc:
        raise RegistryError(f"{path}: invalid YAML: {exc}") from exc

    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        raise ctx.error("expected a mapping with a 'models' key at the top level", root)

    models_node: yaml.Node | None = None
    for key, key_node, value_node in ctx.pairs(root):
        if key == "version":
            version = ctx.value(value_node, key=key)
            if isinstance(version, bool) or version != SCHEMA_VERSION:
                raise ctx.error(
                    f"unsupported schema version {_describe(version)} (expected {SCHEMA_VERSION})",
                    key_node,
                    key=key,
                )
        elif key == "models":
            models_node = value_node
        else:
            raise ctx.error(
                "unknown top-level key (expected 'version' or 'models')", key_node, key=key
            )

    if models_node is None:
        raise ctx.error("missing required key 'models'", root)
    if _is_null(models_node):
        return {}
    if not isinstance(models_node, yaml.MappingNode):
        raise ctx.error(
            f"expected a mapping of model names to entries, got {_describe(ctx.value(models_node))}",
            models_node,
            key="models",
        )

    entries: dict[str, ModelEntry] = {}
    base_dir = path.parent
    for name, knode, vnode in ctx.pairs(models_node, check_duplicates=False):
        try:
            model_name = parse_name(name)
        except InvalidModelName:
            raise ctx.error("invalid model name", knode, name) from None
        previous = entries.get(model_name.key)
        if previous is not None:
            raise ctx.error(
                f"duplicate model name (same as {previous.name!r} on line {previous.line})",
                knode,
                name,
            )
        entries[model_name.key] = _load_entry(ctx, name, knode, vnode, base_dir)
    return entries
