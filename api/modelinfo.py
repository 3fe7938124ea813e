"""What /api/tags and /api/show report, read from the model's files (no weights loaded)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlxd.api.chatformat import chat_format
from mlxd.api.errors import ApiError
from mlxd.api.tokenizerinfo import tokenizer_info
from mlxd.api.types import DraftInfo, ModelSummary, ShowResponse
from mlxd.engine.adapters import AdapterError, locate_adapters
from mlxd.engine.embedding.spec import spec_from_dir
from mlxd.engine.prompt import detect_fim, inserts
from mlxd.registry.adapterfiles import ADAPTER_WEIGHTS, adapter_revision
from mlxd.registry.modelfile import render_modelfile
from mlxd.registry.schema import AdapterRef, ModelEntry, parse_rfc3339, rfc3339
from mlxd.registry.store import (
    ModelDetails,
    files_present,
    model_digest,
    model_size,
    read_details,
    resolve_adapter,
    resolve_local,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModel:
    """A registered model whose files are present (readable as a model, or `problem` says
    why not)."""

    entry: ModelEntry
    target_dir: Path
    draft_dir: Path | None
    details: ModelDetails
    size: int
    digest: str
    modified_at: datetime
    problem: str | None = None

    def usable(self) -> LocalModel:
        """This model, or the error that names it: a broken entry fails only its own
        requests."""
        if self.problem is not None:
            raise ApiError(500, f"model '{self.entry.name}' is unavailable: {self.problem}")
        return self


def find_local(entry: ModelEntry) -> LocalModel | None:
    """The entry's files, None when they are not downloaded. A directory that is not a model
    (or not one mlxd can read) is returned with its `problem`, so one bad registry entry
    never breaks the listings of the others."""
    if not files_present(entry):
        return None
    target = resolve_local(entry.target)
    draft = resolve_local(entry.draft) if entry.draft else None
    if target is None or (entry.draft and draft is None):  # removed meanwhile
        return None
    try:
        return _read_local(entry, target, draft)
    except Exception as exc:
        log.warning("model %s: cannot read its files: %s", entry.name, exc)
        return LocalModel(
            entry=entry,
            target_dir=target,
            draft_dir=draft,
            details=ModelDetails(),
            size=0,
            # still a sha256 (`ollama ls` cuts every digest to 12 characters, and panics
            # on a shorter one): the entry's name and files, which nothing could read
            digest=hashlib.sha256(f"unreadable:{entry.name}:{target}".encode()).hexdigest(),
            modified_at=_mtime([target] + ([draft] if draft else [])),
            problem=str(exc) or type(exc).__name__,
        )


def _mtime(dirs: list[Path]) -> datetime:
    try:
        seconds = max(d.stat().st_mtime for d in dirs)
    except OSError:
        seconds = 0.0
    return datetime.fromtimestamp(seconds, tz=timezone.utc)


def _adapters(entry: ModelEntry) -> tuple[str, int]:
    """The entry's adapters as its ID and size count them, as Ollama counts an adapter layer:
    their content revision (files and scales; another adapter, another ID) and their
    weights' bytes. Adapters not on disk yet count by name."""
    refs = [*entry.adapters, *entry.draft_adapters]
    if not refs:
        return "", 0
    try:
        paths = locate_adapters(refs)
        revision = adapter_revision(paths, [r.scale for r in refs])
        return revision, sum((p / ADAPTER_WEIGHTS).stat().st_size for p in paths)
    except (AdapterError, OSError):
        return "|".join(f"{r.ref}:{r.scale}" for r in refs), 0


def _on_disk(refs: tuple[AdapterRef, ...]) -> list[AdapterRef]:
    """Adapters as a Modelfile names them: a hub repository by the directory it was pulled
    to, as `FROM` names the base (a Modelfile's adapter is a path); one not pulled by name."""
    out = []
    for ref in refs:
        found = None if ref.is_path else resolve_adapter(ref.ref)
        out.append(AdapterRef(str(found), ref.scale) if found is not None else ref)
    return out


def _settings(entry: ModelEntry) -> str:
    """What the entry sets beside its files, for its ID: a model created with another system
    prompt, template, parameters, messages or license is another model (as Ollama's manifest
    digest covers those layers); "" where it sets none."""
    fields = {
        "system": entry.system,
        "template": entry.template,
        "options": dict(entry.options),
        "messages": [dict(m) for m in entry.messages],
        "license": list(entry.license),
    }
    kept = {k: v for k, v in fields.items() if v}
    return json.dumps(kept, sort_keys=True, default=str) if kept else ""


def _read_local(entry: ModelEntry, target: Path, draft: Path | None) -> LocalModel:
    dirs = [target] + ([draft] if draft else [])
    # a model created on a base (its adapters uploaded then) is as new as its adapters
    adapters = [Path(a.ref) for a in (*entry.adapters, *entry.draft_adapters) if a.is_path]
    files = [p for d in dirs + [a for a in adapters if a.is_dir()] for p in d.iterdir()]
    mtime = max((p.stat().st_mtime for p in files if p.is_file()), default=0.0)
    if entry.modified_at:  # created or copied since: a new model, as Ollama's manifest is
        written = parse_rfc3339(entry.modified_at)
        mtime = max(mtime, written.timestamp())
    digest = model_digest(target)
    if draft is not None:
        digest = hashlib.sha256(f"{digest}:{model_digest(draft)}".encode()).hexdigest()
        read_details(draft)  # a draft directory that is not a model breaks the pairing
    revision, adapter_bytes = _adapters(entry)
    if revision:
        digest = hashlib.sha256(f"{digest}:{revision}".encode()).hexdigest()
    settings = _settings(entry)
    if settings:
        digest = hashlib.sha256(f"{digest}:{settings}".encode()).hexdigest()
    return LocalModel(
        entry=entry,
        target_dir=target,
        draft_dir=draft,
        details=read_details(target, context_length=_context_length(entry, target)),
        size=sum(model_size(d) for d in dirs) + adapter_bytes,
        digest=digest,
        modified_at=datetime.fromtimestamp(mtime, tz=timezone.utc),
    )


def _context_length(entry: ModelEntry, target: Path) -> int | None:
    """What a request may use: the entry's, or an embedding model's serving limit (which can
    differ from its config's positions), else the config's (None)."""
    spec = spec_from_dir(entry, target)
    return spec.entry_limit(entry) if spec is not None else entry.context_length


def tag_json(m: LocalModel, unavailable: str | None = None) -> ModelSummary:
    return ModelSummary(
        name=m.entry.name,
        model=m.entry.name,
        modified_at=rfc3339(m.modified_at),
        size=m.size,
        digest=m.digest,
        details=m.details.ollama_details(),
        unavailable=m.problem or unavailable,  # mlxd's extra: why it is not being served
    )


LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md")
LICENSE_MAX_CHARS = 64 * 1024


def license_text(model_dir: Path) -> str | None:
    """The model's license as its directory ships it (a hub repo's `LICENSE.txt`, a local
    model's `LICENSE`), for `show --license`; None where there is none."""
    for name in LICENSE_FILES:
        try:
            with open(model_dir / name, encoding="utf-8", errors="replace") as fh:
                return fh.read(LICENSE_MAX_CHARS).strip() or None
        except OSError:
            continue
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def chat_template(m: LocalModel) -> str:
    if m.entry.template:
        return m.entry.template
    template = _read_json(m.target_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, str):
        return template
    jinja = m.target_dir / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else ""


def capabilities(m: LocalModel) -> list[str]:
    if spec_from_dir(m.entry, m.target_dir) is not None:
        return ["embedding"]
    added = _read_json(m.target_dir / "tokenizer.json").get("added_tokens", [])
    vocab = {t["content"]: t["id"] for t in added if isinstance(t, dict) and "content" in t}
    caps = ["completion"]
    if inserts(detect_fim(vocab), m.entry.template):
        caps.append("insert")
    return caps + chat_format(chat_template(m)).capabilities


def parameters_text(options: dict[str, Any]) -> str:
    rows = []
    for key, value in options.items():
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            rows.append(f"{key:<30} {json.dumps(v)}")
    return "\n".join(rows)


def show_json(m: LocalModel, unavailable: str | None = None, verbose: bool = False) -> ShowResponse:
    entry = m.entry
    template = chat_template(m)
    header = (
        '# Modelfile generated by "mlxd show"\n'
        "# To build a new Modelfile based on this, replace FROM with:\n"
        f"# FROM {entry.name}\n"
    )
    modelfile = render_modelfile(
        str(m.target_dir), _on_disk(entry.adapters), dict(entry.options), entry.system, template,
        [dict(x) for x in entry.messages], header=header,
        draft=str(m.draft_dir) if m.draft_dir else None, licenses=entry.license,
        draft_adapters=_on_disk(entry.draft_adapters),
    )  # fmt: skip
    return ShowResponse(
        modelfile=modelfile,
        parameters=parameters_text(dict(entry.options)),
        template=template,
        details=m.details.ollama_details(),
        model_info={**m.details.model_info(), **tokenizer_info(m.target_dir, verbose)},
        capabilities=capabilities(m),
        modified_at=rfc3339(m.modified_at),
        system=entry.system or None,
        license="\n".join(entry.license) if entry.license else license_text(m.target_dir),
        messages=[dict(m) for m in entry.messages] or None,
        draft=DraftInfo(entry.draft, str(m.draft_dir)) if entry.draft else None,
        unavailable=unavailable,
    )
