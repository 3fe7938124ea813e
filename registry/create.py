"""Creating a model (Ollama's `/api/create`, `mlxd create`): a new user-registry entry on an
existing base, with adapters, parameters, a system prompt, a template or seed messages.

Everything is checked before the entry is written: the base must be known and present, every
adapter blob uploaded, every adapter readable and shaped for the base, every parameter known.
Uploaded adapter files are linked from their blobs into `<MLXD_HOME>/adapters/<digest>/` (the
digest of the file map, so the same upload makes the same directory), assembled in a temporary
directory and renamed into place once whole. The entry is written last, atomically: a failed
create leaves nothing registered.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.registry.adapterfiles import AdapterFileError, check_fits, read_adapter
from mlxd.registry.blobs import BlobError, blob_intact, blob_path, holds, parse_digest
from mlxd.registry.home import user_registry_path
from mlxd.registry.names import InvalidModelName, parse_name
from mlxd.registry.prune import adapters_dir, adapters_lock, prune_replaced, stored_entry
from mlxd.registry.pull import Progress
from mlxd.registry.registry import Registry
from mlxd.registry.schema import KNOWN_OPTIONS, AdapterRef, check_option
from mlxd.registry.store import is_complete_model, resolve_adapter, resolve_local
from mlxd.registry.userfile import adapter_field, entry_fields, set_entry, written_now

__all__ = ["CreateError", "CreateSpec", "create_model"]


class CreateError(ValueError):
    """A create that cannot be done; `status` is what the API answers (400 or 404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class CreateSpec:
    """What to create, as `/api/create` (or a parsed Modelfile) says it."""

    name: str
    from_: str | None = None
    draft: str | None = None  # a draft model directory (replaces the base's)
    adapter_blobs: dict[str, str] = field(default_factory=dict)  # file name -> digest
    adapter_dirs: list[AdapterRef] = field(default_factory=list)  # local directories (Modelfile)
    draft_adapter_dirs: list[AdapterRef] = field(default_factory=list)  # the draft's (Modelfile)
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    messages: list[dict[str, str]] | None = None
    license: list[str] = field(default_factory=list)  # added to the base's


def local_path(raw: str, what: str) -> Path:
    """`raw` as a local path, `~` expanded; one no file system takes (a NUL, an unknown user's
    `~`, a name past the system's length limit) is the request's fault, not the server's."""
    try:
        if "\0" in raw:
            raise ValueError("embedded NUL")
        path = Path(raw).expanduser()
        os.stat(path)
    except FileNotFoundError:
        return path
    except (OSError, RuntimeError, ValueError):
        raise CreateError(f"{what} '{raw[:200]}' is not a valid path") from None
    return path


def _base_fields(spec: CreateSpec, registry: Registry) -> tuple[dict[str, Any], str]:
    """The new entry starts as a copy of `from`: a registry model, or a model directory. Also
    the base's target as this installation finds it (the entry's field may name a model
    shipped in the package, `embedded:...`)."""
    if not spec.from_:
        raise CreateError("neither 'from' or 'files' was specified")
    try:
        entry = registry.get(spec.from_)
    except InvalidModelName:
        entry = None
    if entry is not None:
        return entry_fields(entry), entry.target
    path = local_path(spec.from_, "model")
    if path.is_absolute() and path.is_dir():
        if not is_complete_model(path):
            raise CreateError(f"'{spec.from_}' holds no model (a config.json and its weights)")
        return {"target": str(path.resolve())}, str(path.resolve())
    raise CreateError(f"model '{spec.from_}' not found", 404)


def _options(base: Mapping[str, Any], parameters: Mapping[str, Any]) -> dict[str, Any]:
    options = dict(base)
    for name, value in parameters.items():
        if name not in KNOWN_OPTIONS:
            raise CreateError(f"unknown parameter '{name}'")
        try:
            options[name] = check_option(name, value)
        except ValueError as exc:
            raise CreateError(f"invalid value for parameter '{name}': {exc}") from None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def _assemble(files: Mapping[str, str], env: Mapping[str, str]) -> tuple[Path, str, bool]:
    """The directory holding uploaded adapter files (built from their blobs unless it exists);
    also its digest and whether it was new."""
    digests: dict[str, str] = {}
    for name, digest in files.items():
        if (
            not name
            or any(c in name for c in "/\\\0")
            or name in (".", "..")
            or len(name.encode("utf-8", "surrogatepass")) > 255
        ):
            raise CreateError(f"invalid adapter file name '{name}'")
        try:
            digests[name] = parse_digest(digest)
        except BlobError as exc:
            raise CreateError(f"adapter file '{name}': {exc}") from None
        if not blob_path(digests[name], env).is_file():
            raise CreateError(f"blob {digests[name]} ({name}) not found: upload it first", 404)
        if not blob_intact(digests[name], env):
            raise CreateError(
                f"blob {digests[name]} ({name}) is damaged on disk: upload it again", 404
            )
    key = hashlib.sha256(
        "".join(f"{n}:{d};" for n, d in sorted(digests.items())).encode()
    ).hexdigest()
    final = adapters_dir(env) / key
    if final.is_dir() and all(holds(final / n, d) for n, d in digests.items()):
        return final, "sha256:" + key, False
    # absent, or built from a copy damaged since (its files are links to the blobs): anew
    tmp = final.with_name(f".{key}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, digest in digests.items():
            try:
                os.link(blob_path(digest, env), tmp / name)
            except OSError:
                shutil.copyfile(blob_path(digest, env), tmp / name)
        read_adapter(tmp)  # a broken upload never gets a directory of its own
        if final.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except AdapterFileError as exc:
        said = str(exc).replace(f"adapter {tmp}: {tmp}/", "the uploaded adapter's ")
        raise CreateError(said.replace(f"adapter {tmp}", "the uploaded adapter")) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, "sha256:" + key, True


def _local_adapters(refs: list[AdapterRef]) -> list[AdapterRef]:
    """Adapter directories a Modelfile names, resolved (their scales kept)."""
    out = []
    for ref in refs:
        path = local_path(ref.ref, "adapter path")
        if not path.is_absolute():
            raise CreateError(f"adapter path '{ref.ref}' must be absolute")
        out.append(AdapterRef(str(path.resolve()), ref.scale))
    return out


def _inherited(fields: Mapping[str, Any], key: str) -> list[AdapterRef]:
    """The adapters (`key`) of the entry a model is created from, as its fields write them."""
    return [
        AdapterRef(item["path"], item.get("scale")) if isinstance(item, dict) else AdapterRef(item)
        for item in fields.get(key) or []
    ]


def _added(
    inherited: list[AdapterRef], uploaded: list[AdapterRef], named: list[AdapterRef]
) -> list[AdapterRef]:
    """A created model's adapters: those of the model it is created from, then its own (as
    Ollama adds a Modelfile's adapter layers to its FROM model's), each once."""
    out: list[AdapterRef] = []
    for ref in (*inherited, *uploaded, *_local_adapters(named)):
        if ref not in out:
            out.append(ref)
    return out


def _check_adapters(refs: list[AdapterRef], model: Path) -> None:
    """Refuse adapters that are not here, do not fit `model`, or are DoRA combined with others
    (as a registry entry is refused)."""
    for ref in refs:
        try:
            found = Path(ref.ref) if ref.is_path else resolve_adapter(ref.ref)
            if found is None:
                raise AdapterFileError(f"adapter '{ref.ref}' is not available locally")
            info = read_adapter(found)
            check_fits(info, model)
        except AdapterFileError as exc:
            raise CreateError(str(exc)) from None
        if info.dora and len(refs) > 1:
            raise CreateError(f"adapter {ref.ref}: DoRA adapters cannot be combined")


def _check_draft_adapters(kept: list[AdapterRef], draft: Path) -> None:
    """The source's `draft_adapters` must fit the draft that replaces its own (else every
    request on the model would fail): refused with the adapter named."""
    try:
        _check_adapters(kept, draft)
    except CreateError as exc:
        raise CreateError(
            f"the draft adapters of the model this one is created from do not fit the new "
            f"draft: {exc}"
        ) from None


def _own_template(model_dir: Path) -> str | None:
    """The chat template a model's tokenizer carries."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str):
            return template
        jinja = model_dir / "chat_template.jinja"
        return jinja.read_text(encoding="utf-8") if jinja.is_file() else None
    except (OSError, ValueError):
        return None


def create_model(
    spec: CreateSpec, registry: Registry, env: Mapping[str, str] = os.environ
) -> Iterator[Progress]:
    """Check, then write the entry; yields Ollama's progress statuses. Raises CreateError
    before anything is registered."""
    try:
        name = parse_name(spec.name).display
    except InvalidModelName:
        raise CreateError("invalid model name") from None
    fields, base = _base_fields(spec, registry)
    target = resolve_local(base)
    if target is None:
        raise CreateError(f"model '{spec.from_}' not found, try pulling it first", 404)
    made: list[Path] = []  # adapter directories this create assembled anew
    with adapters_lock(env):  # a delete prunes nothing this create is registering
        replaced = stored_entry(name, registry, env)
        if replaced is not None:
            name = replaced.name  # the name as it is stored, whatever its case here (Ollama's)
        try:
            yield from _fill(spec, fields, target, made, env)
            yield Progress("writing manifest")
            set_entry(name, fields, path=user_registry_path(env))
        except BaseException:
            for path in made:  # an adapter directory nobody will register
                shutil.rmtree(path, ignore_errors=True)
            raise
        if replaced is not None:
            prune_replaced(replaced, registry, env)
    yield Progress("success")


def _fill(
    spec: CreateSpec,
    fields: dict[str, Any],
    target: Path,
    made: list[Path],
    env: Mapping[str, str],
) -> Iterator[Progress]:
    """Complete the new entry's `fields` from `spec`, checking everything; the adapter
    directories it assembles anew are noted in `made`."""
    adapters: list[AdapterRef] = []
    if spec.adapter_blobs or spec.adapter_dirs:
        yield Progress("converting adapter")
        if spec.adapter_blobs:
            path, digest, new = _assemble(spec.adapter_blobs, env)
            if new:
                made.append(path)
            verb = "creating new" if new else "using existing"
            yield Progress(f"{verb} layer {digest}")
            adapters.append(AdapterRef(str(path)))
        adapters = _added(_inherited(fields, "adapters"), adapters, spec.adapter_dirs)
        _check_adapters(adapters, target)
        fields["adapters"] = [adapter_field(r) for r in adapters]
    if spec.parameters or fields.get("options"):
        fields["options"] = _options(fields.get("options") or {}, spec.parameters)
    if spec.system:
        fields["system"] = spec.system
    if spec.template and spec.template != _own_template(target):
        fields["template"] = spec.template  # (the base's own template, as `show` prints it, is
        # not an override: the entry keeps sharing the loaded base)
    if spec.messages is not None:
        fields["messages"] = [{"role": m["role"], "content": m["content"]} for m in spec.messages]
    if spec.draft:
        draft = local_path(spec.draft, "draft model")
        if not draft.is_absolute() or resolve_local(str(draft)) is None:
            raise CreateError(f"draft model '{spec.draft}' not found", 404)
        if not is_complete_model(draft):
            raise CreateError(f"'{spec.draft}' holds no model (a config.json and its weights)")
        fields["draft"] = str(draft.resolve())
        if not spec.draft_adapter_dirs:
            _check_draft_adapters(_inherited(fields, "draft_adapters"), draft)
    if spec.draft_adapter_dirs:
        draft_dir = resolve_local(fields["draft"]) if fields.get("draft") else None
        if draft_dir is None:
            raise CreateError("DRAFT_ADAPTER names an adapter for a draft, but there is no draft")
        refs = _added(_inherited(fields, "draft_adapters"), [], spec.draft_adapter_dirs)
        _check_adapters(refs, draft_dir)
        fields["draft_adapters"] = [adapter_field(r) for r in refs]
    if spec.license:
        fields["license"] = [*fields.get("license", []), *spec.license]
    fields.pop("description", None)
    fields["modified_at"] = written_now()
    with contextlib.suppress(KeyError):
        if not fields["messages"]:
            del fields["messages"]
