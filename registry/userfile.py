"""Editing the user's registry file, ``$MLXD_HOME/models.yaml``, safely.

``mlxd pull``, ``cp`` and ``rm`` add and remove entries in a file that people also edit by
hand, so every change here is:

- *locked*: a read-modify-write holds an exclusive lock (``flock`` on a side file, plus a
  process-wide mutex), so two pulls finishing together never lose each other's entry;
- *atomic*: the new text goes to a temporary file in the same directory, is validated with
  the real loader (:func:`registry.schema.load_registry_file`) and only then replaces the
  file with ``os.replace``; a reader sees the old file or the new one, never half of one;
- *minimal*: the edit is made on the text, touching only the lines of the entry concerned,
  so comments, ordering, ``version: 1`` and every other entry stay as they were. Only when
  that is impossible (a flow-style ``models: {a: ...}`` mapping, or an edit that would break
  YAML anchors) is the file re-serialised, which keeps the data but drops comments.

A file that is already invalid is never rewritten: the error says what to fix first.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from mlxd.registry.home import user_registry_path
from mlxd.registry.names import parse_name
from mlxd.registry.schema import (
    ENTRY_KEYS,
    SCHEMA_VERSION,
    AdapterRef,
    ModelEntry,
    RegistryError,
    load_registry_file,
    portable_ref,
    rfc3339,
)

try:  # POSIX; MLX runs on macOS and Linux
    import fcntl
except ImportError:  # pragma: no cover - Windows: the in-process mutex is all we have
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "NEW_FILE_HEADER",
    "adapter_field",
    "entry_fields",
    "file_lock",
    "remove_entry",
    "set_entry",
]

NEW_FILE_HEADER = (
    "# mlxd user registry: your own models; an entry here overrides a packaged one by name.\n"
    "# `mlxd pull`, `mlxd cp` and `mlxd rm` edit this file and keep everything else in it.\n"
)

_FIELD_ORDER = ENTRY_KEYS  # write fields in the order the schema documents them

_mutexes: dict[str, threading.Lock] = {}
_mutexes_guard = threading.Lock()


def _mutex(path: Path) -> threading.Lock:
    key = str(path)
    with _mutexes_guard:
        return _mutexes.setdefault(key, threading.Lock())


@contextlib.contextmanager
def file_lock(
    lock_path: Path, *, cancel: threading.Event | None = None, poll: float = 0.05
) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created if missing, never deleted).

    Threads of this process are serialised by a mutex, other processes by ``flock``. While
    waiting, ``cancel`` is checked every ``poll`` seconds; once set, :class:`InterruptedError`
    is raised instead of waiting on.
    """
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    mutex = _mutex(lock_path.absolute())
    while not mutex.acquire(timeout=poll):
        if cancel is not None and cancel.is_set():
            raise InterruptedError(f"cancelled while waiting for {lock_path}")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o664)
        try:
            if fcntl is not None:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if cancel is not None and cancel.is_set():
                            raise InterruptedError(
                                f"cancelled while waiting for {lock_path}"
                            ) from None
                        time.sleep(poll)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock
    finally:
        mutex.release()


# -- entries as YAML -----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Options hold tuples and read-only mappings; YAML wants lists and dicts."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def written_now() -> str:
    """An entry's `modified_at` for a write now (a create or copy)."""
    return rfc3339(datetime.now(timezone.utc))


def entry_fields(entry: ModelEntry) -> dict[str, Any]:
    """The registry-file fields of ``entry`` (what ``mlxd cp`` copies), in schema order."""
    fields: dict[str, Any] = {"target": portable_ref(entry.target)}
    if entry.draft is not None:
        fields["draft"] = portable_ref(entry.draft)
    if entry.draft_tokens is not None:
        fields["draft_tokens"] = entry.draft_tokens
    if entry.options:
        fields["options"] = _plain(entry.options)
    for key in ("system", "template", "context_length", "description", "kind", "pooling"):
        value = getattr(entry, key)
        if value is not None:
            fields[key] = value
    if entry.messages:
        fields["messages"] = [dict(m) for m in entry.messages]
    if entry.license:
        fields["license"] = list(entry.license)
    for key in ("adapters", "draft_adapters"):
        refs = getattr(entry, key)
        if refs:
            fields[key] = [adapter_field(r) for r in refs]
    return fields


def adapter_field(ref: AdapterRef) -> Any:
    """An adapter as the registry file writes it: its path, with its scale when set."""
    return ref.ref if ref.scale is None else {"path": ref.ref, "scale": ref.scale}


def _ordered(fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in fields if k not in _FIELD_ORDER]
    if unknown:
        raise ValueError(f"unknown registry entry keys: {', '.join(unknown)}")
    if not fields.get("target"):
        raise ValueError("a registry entry needs a target")
    return {k: _plain(fields[k]) for k in _FIELD_ORDER if fields.get(k) is not None}


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (a system prompt, a template) as ``|`` blocks, as people
    write them by hand; PyYAML falls back to quoting where a block cannot hold the text. Text
    ending in blank lines stays quoted: its block (``|+``) would end the document (``...``)."""


# characters a YAML reader takes as line breaks (or drops) wherever they stand unescaped: a
# value holding one is written double-quoted, where the emitter escapes it ("\N", "\L", ...)
_BREAKS = frozenset("\x85\u2028\u2029\r")


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if _BREAKS.intersection(value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    style = "|" if "\n" in value and not value.endswith("\n\n") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(data: Any) -> str:
    return yaml.dump(
        data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True,
        width=1_000_000,
    )  # fmt: skip


def _block(name: str, fields: Mapping[str, Any], indent: int) -> str:
    """One ``name: {fields}`` entry as block YAML, indented to sit under ``models:``."""
    text = _dump({name: _ordered(fields)})
    pad = " " * indent
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


# -- text surgery ---------------------------------------------------------------------------


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _line_end(text: str, index: int) -> int:
    """Index just past the newline ending the line that contains ``index``."""
    end = text.find("\n", index)
    return len(text) if end < 0 else end + 1


def _content_end(node: yaml.Node) -> yaml.Mark:
    """Where the last character of a node's own content is (not the next token's start).

    A block collection's end mark is the position of whatever follows it, past any comment
    lines in between; its last scalar (or flow collection) ends where the text really ends.
    """
    if isinstance(node, yaml.MappingNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1][1])
    if isinstance(node, yaml.SequenceNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1])
    return node.end_mark


def _span_end(text: str, value: yaml.Node) -> int:
    mark = _content_end(value)
    index = mark.index
    if text[_line_start(text, index) : index].strip() != "":
        return _line_end(text, index)  # include the rest of the line (e.g. an inline comment)
    # a block scalar ends at the start of the line after it, past the blank lines that
    # follow it: those separate it from the next entry and stay
    end = _line_start(text, index)
    while end > 0:
        start = _line_start(text, end - 1)
        if text[start:end].strip():
            break
        end = start
    return end


def _comments_above(text: str, start: int) -> int:
    """Where the comment lines directly above the line at ``start`` begin (no blank line
    between): they describe that entry, and go with it when it is removed."""
    while start > 0:
        above = _line_start(text, start - 1)
        if not text[above:start].lstrip().startswith("#"):
            break
        start = above
    return start


def _models_node(root: yaml.Node) -> tuple[yaml.Node, yaml.Node] | None:
    if not isinstance(root, yaml.MappingNode):
        return None
    for key, value in root.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "models":
            return key, value
    return None


def _same_name(a: str, b: str) -> bool:
    try:
        return parse_name(a).key == parse_name(b).key
    except ValueError:
        return False


def _edit_text(text: str, name: str, fields: Mapping[str, Any] | None) -> str | None:
    """The file text with ``name`` set to ``fields`` (or removed when None), edited in place.

    Returns None when the text cannot be edited in place (the caller re-serialises), and the
    unchanged text when removing a name that is not there.
    """
    root = yaml.compose(text, Loader=yaml.SafeLoader) if text.strip() else None
    if root is None:
        if fields is None:
            return text
        if not text.strip():
            prefix = NEW_FILE_HEADER
        else:
            prefix = text if text.endswith("\n") else text + "\n"
        return f"{prefix}version: {SCHEMA_VERSION}\nmodels:\n{_block(name, fields, 2)}"

    found = _models_node(root)
    if found is None:
        return None
    models_key, models = found

    if isinstance(models, yaml.ScalarNode) or (
        isinstance(models, yaml.MappingNode) and models.flow_style and not models.value
    ):
        # `models:` / `models: null` / `models: {}`: nothing to remove, replace the value.
        if fields is None:
            return text
        start, end = models.start_mark.index, models.end_mark.index
        indent = models_key.start_mark.column + 2
        rest = text[end:]
        if rest and not rest.startswith("\n"):
            rest = "\n" + rest
        return f"{text[:start].rstrip(' ')}\n{_block(name, fields, indent).rstrip(chr(10))}{rest}"

    if not isinstance(models, yaml.MappingNode) or models.flow_style:
        return None

    pairs = models.value
    if not pairs:
        return None
    indent = pairs[0][0].start_mark.column
    for key, value in pairs:
        if isinstance(key, yaml.ScalarNode) and _same_name(str(key.value), name):
            start = _line_start(text, key.start_mark.index)
            end = _span_end(text, value)
            if fields is None:
                start = _comments_above(text, start)
            replacement = "" if fields is None else _block(name, fields, indent)
            return text[:start] + replacement + text[end:]
    if fields is None:
        return text
    end = _span_end(text, pairs[-1][1])
    before = text[:end] if text[:end].endswith("\n") or not end else text[:end] + "\n"
    return before + _block(name, fields, indent) + text[end:]


def _redump(text: str, name: str, fields: Mapping[str, Any] | None) -> str:
    """Fallback: rebuild the whole file from its data (comments are lost)."""
    data = yaml.safe_load(text) if text.strip() else None
    if not isinstance(data, dict):
        data = {}
    models = data.get("models")
    if not isinstance(models, dict):
        models = {}
    kept = {k: v for k, v in models.items() if not _same_name(str(k), name)}
    if fields is not None:
        kept[name] = _ordered(fields)
    out: dict[str, Any] = {"version": data.get("version", SCHEMA_VERSION)}
    out.update({k: v for k, v in data.items() if k not in ("version", "models")})
    out["models"] = kept
    return NEW_FILE_HEADER + _dump(out)


def _has(entries: Mapping[str, ModelEntry], name: str) -> bool:
    return parse_name(name).key in entries


def _write_checked(path: Path, text: str, name: str, present: bool) -> bool:
    """Write ``text`` to a temp file, validate it, then atomically replace ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            entries = load_registry_file(tmp)
        except RegistryError:
            return False
        if _has(entries, name) != present:
            return False
        os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _modify(path: Path | None, name: str, fields: Mapping[str, Any] | None) -> bool:
    """Set (fields) or remove (None) one entry. Returns whether the file changed."""
    parse_name(name)  # InvalidModelName before touching anything
    path = Path(path) if path is not None else user_registry_path(os.environ)
    path = path.expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(f".{path.name}.lock")
    with file_lock(lock):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            text = ""
        if text.strip():
            # Never rewrite a broken file: the user must see and fix their own mistake.
            before = load_registry_file(path)
            if fields is None and not _has(before, name):
                return False
        elif fields is None:
            return False
        edited = _edit_text(text, name, fields)
        if edited == text:
            return False
        present = fields is not None
        if edited is not None and _write_checked(path, edited, name, present):
            return True
        if _write_checked(path, _redump(text, name, fields), name, present):
            return True
        raise RegistryError(f"{path}: could not update entry {name!r} without breaking the file")


def set_entry(name: str, fields: Mapping[str, Any], *, path: Path | None = None) -> None:
    """Add or replace the entry ``name`` in the user registry (default ``$MLXD_HOME/models.yaml``).

    ``fields`` are registry-file keys (``target``, ``draft``, ``options``...); an existing entry
    with the same name (matched case-insensitively) is replaced where it stands.
    """
    _modify(path, name, fields)


def remove_entry(name: str, *, path: Path | None = None) -> bool:
    """Remove the entry ``name`` from the user registry; False when it was not there."""
    return _modify(path, name, None)
