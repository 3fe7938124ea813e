"""Pulling models from the Hugging Face hub, with Ollama-shaped progress; removing and copying.

:func:`pull` is a generator of :class:`Progress` objects, the same statuses ``ollama pull``
streams: ``pulling manifest``, one ``pulling <digest12>`` series per file, ``verifying sha256
digest``, ``writing manifest``, ``success``. What it pulls:

- a registry name (``qwen2.5-coder:7b``): the entry's target and draft repos;
- ``org/repo`` or ``hf.co/org/repo[:revision]``: that repo, registered afterwards in the user
  registry as ``hf.co/org/repo:<revision or latest>``.

Files land in the ordinary Hugging Face hub cache, so ``mlx_lm`` and the ``hf`` CLI share
them, and a model already there is not downloaded again. How a file gets there:

1. the repo's listing (``HfApi.model_info(files_metadata=True)``) gives each file's size,
   git oid and, for LFS files, sha256; only :data:`~registry.store.MODEL_FILE_PATTERNS` files
   are fetched, pinned to the listed commit;
2. a missing file is downloaded with huggingface_hub's ``http_get`` into
   ``blobs/<etag>.incomplete``, which is kept when a pull fails or is cancelled, so the next
   pull resumes it with a ``Range`` request (huggingface_hub's own temporary files are unique
   per attempt and deleted on failure, so they cannot resume across pulls);
3. once every file is down, each new one is checked (size, and sha256 for LFS files or the
   git blob hash for the others); only then is it moved to ``blobs/<etag>`` and linked into
   ``snapshots/<commit>`` the way huggingface_hub lays out its cache (a relative symlink);
4. last, ``refs/<revision>`` is written and, for hub names, the registry entry: until then
   :func:`~registry.store.resolve_local` cannot see the new snapshot, so a partial or
   unverified download is never listed or served.

Configuration is read from the environment at call time (``HF_ENDPOINT``, ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``); huggingface_hub itself reads most of
these once at import, so they are passed explicitly to every call.

Nothing the hub sends is trusted as a path: listed file names must be plain relative paths of
allowed characters, and blob names (LFS sha256, git oid) must be hex digests of the right
length, before anything is downloaded; an ETag the hub answers is only ever compared, never
used as a name. A hub that sends anything else fails the pull with an error saying so.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_url,
    scan_cache_dir,
)
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    CacheNotFound,
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get, repo_folder_name
from huggingface_hub.utils import build_hf_headers, filter_repo_objects

from mlxd.registry.home import user_registry_path
from mlxd.registry.names import HUB_HOSTS, ModelName, hub_name, parse_name
from mlxd.registry.prune import adapters_lock, prune_adapters, prune_replaced, stored_entry
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry, RegistryError
from mlxd.registry.store import (
    ADAPTER_FILES,
    MODEL_FILE_PATTERNS,
    ModelFilesError,
    file_hashes,
    files_present,
    hub_cache_dir,
    model_files,
    remember_hash,
    resolve_local,
)
from mlxd.registry.userfile import entry_fields, file_lock, remove_entry, set_entry, written_now

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ENDPOINT",
    "HUB_HOSTS",
    "DeleteError",
    "HubRef",
    "Progress",
    "PullError",
    "PullPlan",
    "Removal",
    "copy_model",
    "delete_model",
    "hub_endpoint",
    "hub_name",
    "hub_offline",
    "plan_pull",
    "pull",
    "user_file_in_use",
]

DEFAULT_ENDPOINT = "https://huggingface.co"
PROGRESS_INTERVAL = 0.08  # seconds between progress objects while a file downloads
DOWNLOAD_CHUNK = 1024 * 1024  # bytes per read: how often progress moves and a cancel is seen
# the manifest's request (huggingface_hub sets no limit on it): a hub that never answers is a
# clear error, not a pull that waits for ever (a large repo's listing takes a few seconds)
MANIFEST_TIMEOUT_S = 30.0

_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_SHA1_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
# One segment of a listed file name: the characters real model repos use, nothing that a
# file system or a shell reads specially (no separators, NUL, control characters, "..").
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.+=@,~-][A-Za-z0-9_.+=@,~ -]{0,254}")
_NAME_MAX = 1024
_HASH_CHUNK = 4 * 1024 * 1024


# -- results and errors ---------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One object of Ollama's pull stream (``ProgressResponse``)."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The wire form: Ollama omits empty fields, including ``completed`` while it is 0."""
        out: dict[str, Any] = {"status": self.status}
        if self.digest:
            out["digest"] = self.digest
        if self.total:
            out["total"] = self.total
        if self.completed:
            out["completed"] = self.completed
        return out


class PullError(Exception):
    """A pull that cannot finish; the message is what the client sees."""


class PullNotFound(PullError):
    """Nothing by that name: not on the hub, not on disk."""


class NotPullable(PullError):
    """The repo holds no files of the kind asked for (no model, no adapter): the request's
    fault, not the server's."""


class PullRefused(PullError):
    """This server's configuration could not serve what the pull would bring."""


class PullCancelled(PullError):
    def __init__(self) -> None:
        super().__init__("pull cancelled")


class DeleteError(Exception):
    """A model that cannot be deleted; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- environment ----------------------------------------------------------------------------


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_endpoint(env: Mapping[str, str] = os.environ) -> str:
    """``$HF_ENDPOINT`` (a mirror or a test server), else the public hub."""
    return (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).strip().rstrip("/")


def hub_offline(env: Mapping[str, str] = os.environ) -> bool:
    """``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    return _is_true(env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE"))


def _token(env: Mapping[str, str]) -> str | None:
    """``$HF_TOKEN``; None lets huggingface_hub look further (the saved login token)."""
    return (env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or "").strip() or None


_session_lock = threading.Lock()
_session_users = 0
_session_saved: tuple[bool, int] = (False, 0)


@contextlib.contextmanager
def _hub_session(offline: bool) -> Iterator[None]:
    """Make huggingface_hub follow this pull's view of offline mode, and read in small chunks.

    huggingface_hub decides ``HF_HUB_OFFLINE`` once, at import, and refuses every request
    afterwards if it was set then; a daemon started offline must still pull once the
    variable is cleared. Its download chunk (10 MiB) would also make progress jump and
    cancels lag, so pulls read :data:`DOWNLOAD_CHUNK` at a time. Both are process-wide
    settings: they are changed while at least one pull runs and restored after the last.
    """
    global _session_users, _session_saved
    with _session_lock:
        if _session_users == 0:
            _session_saved = (hf_constants.HF_HUB_OFFLINE, hf_constants.DOWNLOAD_CHUNK_SIZE)
        _session_users += 1
        hf_constants.HF_HUB_OFFLINE = offline
        hf_constants.DOWNLOAD_CHUNK_SIZE = DOWNLOAD_CHUNK
    try:
        yield
    finally:
        with _session_lock:
            _session_users -= 1
            if _session_users == 0:
                hf_constants.HF_HUB_OFFLINE, hf_constants.DOWNLOAD_CHUNK_SIZE = _session_saved


def _norm(path: Path | str) -> Path:
    return Path(path).expanduser().absolute()


def user_file_in_use(registry: Registry, env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``registry`` reads the user registry file (not so under ``--registry``)."""
    user = _norm(user_registry_path(env))
    return any(_norm(p) == user for p in registry.paths)


# -- what to pull ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HubRef:
    """A hub repo at a revision: a branch or tag (``main`` for ``latest``) or a commit."""

    repo_id: str
    revision: str = "main"
    adapter: bool = False  # a LoRA adapter's repo (an entry's `adapters:`), not a model's

    @property
    def pinned(self) -> bool:
        return _COMMIT_RE.fullmatch(self.revision) is not None

    @property
    def patterns(self) -> tuple[str, ...]:
        """The files of the repo a pull fetches."""
        return ADAPTER_FILES if self.adapter else MODEL_FILE_PATTERNS


@dataclass(frozen=True)
class PullPlan:
    """What a pull fetches and under which name the result is served."""

    name: str  # Ollama display name
    hub: tuple[HubRef, ...]  # target first, then the draft, then adapters
    local: tuple[Path, ...] = ()  # local directories the entry points at (must exist)
    register: bool = False  # add ``name`` to the user registry once the files are in
    keep: Mapping[str, Any] = field(default_factory=dict)  # the entry's fields a pull keeps


def _cache_ref(target: str, env: Mapping[str, str]) -> HubRef | Path:
    """A registry ``target``/``draft`` as a hub ref; a path into the hub cache's
    ``snapshots/<commit>`` is that repo pinned at that commit, any other path stays a path."""
    if not os.path.isabs(target):
        return HubRef(target)
    path = Path(target)
    try:
        rel = path.resolve().relative_to(hub_cache_dir(env).expanduser().resolve())
    except ValueError:
        return path
    parts = rel.parts
    if (
        len(parts) == 3
        and parts[0].startswith("models--")
        and parts[1] == "snapshots"
        and _COMMIT_RE.fullmatch(parts[2])
    ):
        return HubRef(parts[0][len("models--") :].replace("--", "/"), parts[2])
    return path


def _entry_plan(entry: ModelEntry, env: Mapping[str, str]) -> PullPlan:
    hub: list[HubRef] = []
    local: list[Path] = []
    for found in _hub_refs(entry, env):
        if isinstance(found, HubRef):
            hub.append(found)
        else:
            local.append(found)
    return PullPlan(name=entry.name, hub=tuple(hub), local=tuple(local))


def plan_pull(
    ref: str, registry: Registry | None = None, env: Mapping[str, str] = os.environ
) -> PullPlan:
    """Resolve what ``ref`` means: a registry entry first, else a hub repo.

    Raises :class:`~registry.names.InvalidModelName` for a malformed name and
    :class:`PullError` for one that is neither registered nor a hub repo.
    """
    name = parse_name(ref)
    hub = hub_name(name)
    entry = registry.get(ref) if registry is not None else None
    if entry is None and hub is not None and registry is not None:
        entry = registry.get(hub.display)  # pulled before (or configured) under its hub name
    if entry is not None and not (hub is not None and _tag_moves(entry, hub, env)):
        return _entry_plan(entry, env)
    if hub is None:
        raise PullNotFound("pull model manifest: file does not exist")
    revision = "main" if hub.tag.lower() == "latest" else hub.tag
    return PullPlan(
        name=entry.name if entry is not None else hub.display,  # a moved tag: its own entry
        hub=(HubRef(f"{hub.namespace}/{hub.model}", revision),),
        register=True,
        keep=entry_fields(entry) if entry is not None else {},
    )


def _tag_moves(entry: ModelEntry, hub: ModelName, env: Mapping[str, str]) -> bool:
    """Whether `entry` is a pull of `hub`'s tag (registered at the commit the tag named then),
    which a pull must look up again, as `ollama pull model:tag` does: the tag may have moved.
    A `latest` entry follows the hub's main branch by itself; a commit never moves."""
    if hub.tag.lower() == "latest" or _COMMIT_RE.fullmatch(hub.tag) or entry.draft is not None:
        return False
    pinned = _cache_ref(entry.target, env)
    return (
        isinstance(pinned, HubRef)
        and pinned.pinned
        and pinned.repo_id.lower() == f"{hub.namespace}/{hub.model}".lower()
    )


# -- manifests and jobs ---------------------------------------------------------------------


@dataclass(frozen=True)
class _RemoteFile:
    path: str
    size: int
    oid: str  # git blob sha1 ("" when unknown, offline)
    sha256: str | None  # LFS files only

    @property
    def etag(self) -> str:
        """The hub's ETag for this file, which is also its blob name in the cache."""
        return self.sha256 or self.oid


@dataclass(frozen=True)
class _Manifest:
    ref: HubRef
    commit: str
    files: tuple[_RemoteFile, ...]
    storage: Path  # <cache>/models--org--repo
    offline: bool = False

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit


@dataclass
class _Job:
    manifest: _Manifest
    file: _RemoteFile
    state: str  # "cached" (linked in the snapshot), "link" (blob present), "download"

    @property
    def repo_id(self) -> str:
        return self.manifest.ref.repo_id

    @property
    def blob(self) -> Path:
        return self.manifest.storage / "blobs" / self.file.etag

    @property
    def partial(self) -> Path:
        return self.blob.with_name(self.file.etag + ".incomplete")

    @property
    def lock(self) -> Path:
        folder = self.manifest.storage.name
        return self.manifest.storage.parent / ".locks" / folder / f"{self.file.etag}.mlxd.lock"

    @property
    def digest(self) -> str:
        """``sha256:<hex>``: the LFS sha256, or a stable stand-in for small git files."""
        if self.file.sha256:
            return f"sha256:{self.file.sha256}"
        key = f"{self.repo_id}/{self.file.path}\0{self.file.size}".encode()
        return f"sha256:{hashlib.sha256(key).hexdigest()}"

    @property
    def status(self) -> str:
        return f"pulling {self.digest[7:19]}"

    def progress(self, completed: int) -> Progress:
        return Progress(self.status, self.digest, self.file.size, completed)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _safe_name(name: str) -> bool:
    """A relative path of plain segments that cannot leave the snapshot directory."""
    if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX:
        return False
    return all(
        _SEGMENT_RE.fullmatch(seg) is not None and seg not in (".", "..") and seg[-1] != " "
        for seg in name.split("/")
    )


def _under(path: Path, root: Path) -> bool:
    """Whether ``path`` stays inside ``root`` once ``..`` are resolved (lexically: the cache
    itself may be a symlink to another disk)."""
    real = os.path.normpath(os.path.abspath(path))
    top = os.path.normpath(os.path.abspath(root))
    return real.startswith(top + os.sep)


def _checked_file(repo_id: str, name: str, size: Any, oid: Any, sha256: Any) -> _RemoteFile:
    """A listed file, once every name in it is safe to build a path from."""
    what = f"pull model manifest: {repo_id}: the hub sent"
    if not _safe_name(name):
        raise PullError(f"{what} an unsafe file name {name!r}")
    if not isinstance(oid, str) or _SHA1_RE.fullmatch(oid) is None:
        raise PullError(f"{what} a bad git id {oid!r} for {name}")
    if sha256 is not None and (not isinstance(sha256, str) or _SHA256_RE.fullmatch(sha256) is None):
        raise PullError(f"{what} a bad sha256 {sha256!r} for {name}")
    if not isinstance(size, int) or size < 0:
        raise PullError(f"{what} a bad size {size!r} for {name}")
    return _RemoteFile(name, size, oid, sha256)


def _fetch_manifest(ref: HubRef, api: HfApi, cache: Path) -> _Manifest:
    info = api.model_info(
        ref.repo_id, revision=ref.revision, files_metadata=True, timeout=MANIFEST_TIMEOUT_S
    )
    commit = info.sha or ""
    if not _COMMIT_RE.fullmatch(commit):
        raise PullError(
            f"pull model manifest: {ref.repo_id}: the hub sent no commit for {ref.revision}"
        )
    files: list[_RemoteFile] = []
    for sibling in filter_repo_objects(
        info.siblings or [], allow_patterns=list(ref.patterns), key=lambda s: s.rfilename
    ):
        if sibling.size is None or not sibling.blob_id:
            raise PullError(
                f"pull model manifest: {ref.repo_id}: no size or id for {sibling.rfilename}"
            )
        sha = sibling.lfs.sha256 if sibling.lfs is not None else None
        files.append(
            _checked_file(ref.repo_id, sibling.rfilename, sibling.size, sibling.blob_id, sha)
        )
    names = {f.path for f in files}
    if ref.adapter and not names >= set(ADAPTER_FILES):
        raise NotPullable(
            f"pull model manifest: {ref.repo_id} has no adapter files"
            f" ({' and '.join(ADAPTER_FILES)}, in mlx-lm's layout)"
        )
    if ADAPTER_FILES[0] in names and "config.json" not in names and not ref.adapter:
        raise NotPullable(
            f"pull model manifest: {ref.repo_id} is a LoRA adapter, not a model: name it in"
            " an entry's `adapters:` (models.yaml) and pull that entry"
        )
    if not ref.adapter and (
        "config.json" not in names or not any(n.endswith(".safetensors") for n in names)
    ):
        raise NotPullable(
            f"pull model manifest: {ref.repo_id} has no MLX model files"
            " (config.json and *.safetensors)"
        )
    storage = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    manifest = _Manifest(ref, commit, tuple(sorted(files, key=lambda f: f.path)), storage)
    for f in manifest.files:  # the checks above make this hold; a last guard before writing
        if not (_under(manifest.snapshot / f.path, storage) and _under(storage, cache)):
            raise PullError(f"pull model manifest: {ref.repo_id}: unsafe file name {f.path!r}")
    return manifest


def _manifest(ref: HubRef, api: HfApi, cache: Path, endpoint: str) -> _Manifest:
    """`_fetch_manifest`; what fails for an entry's adapter names it (its model's failures
    read as Ollama words them)."""
    try:
        return _fetch_manifest(ref, api, cache)
    except Exception as exc:
        what = (
            f"pull model manifest: adapter {ref.repo_id}" if ref.adapter else "pull model manifest"
        )
        raise _explain(exc, what, endpoint) from exc


def _offline_manifest(ref: HubRef, cache: Path, env: Mapping[str, str]) -> _Manifest:
    folder = resolve_local(ref.repo_id, revision=ref.revision, env=env, adapter=ref.adapter)
    if folder is None:
        raise PullError(
            f"pull model manifest: {ref.repo_id} is not in the local cache and offline mode"
            " is enabled (HF_HUB_OFFLINE is set)"
        )
    listed = [folder / name for name in ADAPTER_FILES] if ref.adapter else model_files(folder)
    files = tuple(_RemoteFile(f.name, f.stat().st_size, "", None) for f in listed)
    storage = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    return _Manifest(ref, folder.name, files, storage, offline=True)


def _plan_job(manifest: _Manifest, file: _RemoteFile) -> _Job:
    """What a file needs: nothing where the snapshot holds it intact, a link where its blob
    is there, else a download. A file of the right size whose content no longer hashes to
    what the hub lists (damaged on disk) is downloaded again: pulling again repairs a model.
    Hashes come from the digest cache while a file's size and mtime are unchanged, so a
    model is read once, not at every pull."""
    pointer = manifest.snapshot / file.path
    if manifest.offline or (_size(pointer) == file.size and _intact(pointer, file)):
        return _Job(manifest, file, "cached")
    job = _Job(manifest, file, "download")
    if _size(job.blob) == file.size:
        if _intact(job.blob, file):
            job.state = "link"
        else:
            _drop_damaged(job)
    return job


def _intact(path: Path, file: _RemoteFile) -> bool:
    """Whether the file at `path` hashes to what the hub lists for `file`."""
    try:
        if file.sha256:
            ((_, sha256),) = file_hashes([path])
            return sha256 == file.sha256
        if file.oid:
            return _file_hashes(path, file.size)[1] == file.oid
    except (OSError, ModelFilesError):
        return False
    return True


def _drop_damaged(job: _Job) -> None:
    """Remove a blob whose content does not match its name, so the download replaces it."""
    log.warning(
        "pull %s: %s does not match the hub's digest; downloading it again",
        job.repo_id, job.file.path,
    )  # fmt: skip
    with file_lock(job.lock):
        if _size(job.blob) == job.file.size and not _intact(job.blob, job.file):
            with contextlib.suppress(FileNotFoundError):
                job.blob.unlink()


def _check_space(jobs: Sequence[_Job], cache: Path) -> None:
    need = sum(j.file.size - (_size(j.partial) or 0) for j in jobs if j.state == "download")
    if need <= 0:
        return
    probe = cache
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return
    if need > free:
        raise PullError(
            f"no space left on device: the download needs {_human(need)} in {cache},"
            f" {_human(free)} is free"
        )


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- errors ---------------------------------------------------------------------------------


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _network_error(exc: BaseException) -> bool:
    """httpx (or httpx2, which huggingface_hub 2.x uses) transport errors, by class name so
    either library version works: connect/read failures, timeouts, broken connections."""
    return any(
        cls.__name__ in ("TransportError", "TimeoutException")
        and cls.__module__.split(".")[0].startswith("httpx")
        for cls in type(exc).__mro__
    )


def _explain(exc: BaseException, what: str, endpoint: str) -> PullError:
    """Turn whatever huggingface_hub, httpx or the OS raised into a message for the client."""
    for link in _chain(exc):
        if isinstance(link, PullError):
            return link
        if isinstance(link, OSError) and link.errno == errno.ENOSPC:
            return PullError("no space left on device")
    if isinstance(exc, GatedRepoError):
        return PullError(
            f"{what}: access to this repo is gated: accept its conditions on the hub"
            " and set HF_TOKEN"
        )
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
        return PullNotFound(f"{what}: file does not exist")
    if isinstance(exc, OfflineModeIsEnabled):
        return PullError(f"{what}: offline mode is enabled (HF_HUB_OFFLINE is set)")
    if isinstance(exc, HfHubHTTPError):  # an answer, even if an earlier attempt broke off
        status = exc.response.status_code if exc.response is not None else "?"
        return PullError(f"{what}: {endpoint} answered HTTP {status}")
    for link in _chain(exc):
        if _network_error(link):
            reason = str(link) or type(link).__name__
            return PullError(f"{what}: cannot reach {endpoint}: {reason}")
    return PullError(f"{what}: {exc or type(exc).__name__}")


# -- downloading ----------------------------------------------------------------------------


def _cancel_hook(cancel: threading.Event) -> type:
    """A stand-in for huggingface_hub's tqdm bar: ``http_get`` calls ``update`` after every
    chunk, which is where a cancelled pull stops the transfer."""

    class _Hook:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> _Hook:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: float | None = 1) -> None:
            if cancel.is_set():
                raise PullCancelled()

        def close(self) -> None:
            pass

    return _Hook


def _download(job: _Job, endpoint: str, token: str | None, cancel: threading.Event) -> None:
    """Fetch one file into its ``.incomplete`` file, resuming what is already there."""
    with file_lock(job.lock, cancel=cancel):
        if _size(job.blob) == job.file.size:
            job.state = "link"  # another pull finished it while we waited
            return
        url = hf_hub_url(
            job.repo_id, job.file.path, revision=job.manifest.commit, endpoint=endpoint
        )
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
        if meta.etag and (
            _SHA1_RE.fullmatch(meta.etag) is None and _SHA256_RE.fullmatch(meta.etag) is None
        ):
            raise PullError(
                f"pull {job.repo_id}/{job.file.path}: the hub sent a bad ETag {meta.etag[:80]!r}"
            )
        if meta.etag and job.file.etag and meta.etag != job.file.etag:
            raise PullError(
                f"pull {job.repo_id}/{job.file.path}: the hub serves a different file than it"
                " lists; try again"
            )
        location = meta.location or url
        headers = build_hf_headers(token=token)
        if urlsplit(location).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # never send the token to a CDN
        job.partial.parent.mkdir(parents=True, exist_ok=True)
        resume = _size(job.partial) or 0
        if resume > job.file.size:
            job.partial.unlink()
            resume = 0
        with open(job.partial, "ab") as f:
            f.seek(0, os.SEEK_END)
            http_get(
                location,
                f,
                resume_size=resume,
                headers=headers,
                expected_size=job.file.size,
                displayed_filename=job.file.path,
                tqdm_class=cast(Any, _cancel_hook(cancel)),
            )


def _transfer(
    job: _Job, endpoint: str, token: str | None, cancel: threading.Event
) -> Iterator[Progress]:
    """Progress for one file: once if present, else every PROGRESS_INTERVAL while it downloads
    (the size of the ``.incomplete`` file, which also shows another pull filling it)."""
    total = job.file.size
    if job.state != "download":
        yield job.progress(total)
        return
    failure: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            _download(job, endpoint, token, cancel)
        except BaseException as exc:
            failure.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=work, name=f"mlxd-pull {job.file.path}", daemon=True)
    yield job.progress(min(_size(job.partial) or 0, total))  # where it starts (or resumes)
    worker.start()
    try:
        while not done.wait(PROGRESS_INTERVAL):
            yield job.progress(min(_size(job.partial) or 0, total))
    finally:
        if not done.is_set():  # the consumer went away: stop the transfer, keep the partial
            cancel.set()
            done.wait()
    if failure:
        exc = failure[0]
        if isinstance(exc, (PullCancelled, InterruptedError)):
            raise PullCancelled() from exc
        raise _explain(exc, f"pull {job.repo_id}/{job.file.path}", endpoint) from exc
    yield job.progress(total)


# -- verifying and committing ---------------------------------------------------------------


def _file_hashes(path: Path, size: int) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file, in one read."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def _verify_and_commit(job: _Job, cancel: threading.Event) -> None:
    """Check a downloaded file against the hub's hashes and move it into ``blobs/``."""
    with file_lock(job.lock, cancel=cancel):
        if _size(job.blob) == job.file.size:
            with contextlib.suppress(FileNotFoundError):
                job.partial.unlink()  # another pull committed the same blob
            job.state = "link"
            return
        got = _size(job.partial)
        name = f"{job.file.path} in {job.repo_id}"
        if got != job.file.size:
            with contextlib.suppress(FileNotFoundError):
                job.partial.unlink()
            raise PullError(
                f"digest mismatch for {name}: expected {job.file.size} bytes, got {got or 0}"
            )
        sha256, git = _file_hashes(job.partial, job.file.size)
        expected, actual = (job.file.sha256, sha256) if job.file.sha256 else (job.file.oid, git)
        if expected and actual != expected:
            job.partial.unlink()
            raise PullError(
                f"digest mismatch for {name}: the hub lists {expected[:12]}…, the download"
                f" hashes to {actual[:12]}…"
            )
        os.replace(job.partial, job.blob)
        if job.file.sha256:
            remember_hash(job.blob, sha256)  # verified now: later pulls need not read it again
        job.state = "link"


def _link(job: _Job) -> None:
    """Point ``snapshots/<commit>/<path>`` at ``blobs/<etag>`` with a relative symlink, as
    huggingface_hub does (a copy where the file system has no symlinks).

    Done here rather than by ``hf_hub_download``, which asks the hub again and builds the
    blob's path from whatever ETag it answers; these paths come from the checked listing.
    """
    pointer = job.manifest.snapshot / job.file.path
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.symlink(os.path.relpath(job.blob, pointer.parent), tmp)
    except OSError:
        shutil.copyfile(job.blob, tmp)
    os.replace(tmp, pointer)
    job.state = "cached"


def _write_ref(manifest: _Manifest) -> None:
    """Point ``refs/<revision>`` at the commit: the moment the new snapshot becomes visible."""
    ref = manifest.ref
    if ref.pinned or manifest.offline:
        return
    path = manifest.storage / "refs" / ref.revision
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text() == manifest.commit:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(manifest.commit)
    os.replace(tmp, path)


def _registration(manifest: _Manifest) -> dict[str, Any]:
    ref = manifest.ref
    if ref.revision == "main":
        return {"target": ref.repo_id}
    return {"target": str(manifest.snapshot)}  # a tag, branch or commit: that exact snapshot


# -- pull -----------------------------------------------------------------------------------


def pull(
    ref: str,
    *,
    registry: Registry | None = None,
    env: Mapping[str, str] | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[Progress]:
    """Pull ``ref`` (a registry name, ``org/repo`` or ``hf.co/org/repo[:revision]``).

    Yields :class:`Progress` objects; raises :class:`PullError` with the message to show
    (after ``pulling manifest`` has been yielded, as Ollama streams its errors) and
    :class:`~registry.names.InvalidModelName` for a malformed name before anything. Setting
    ``cancel`` (or closing the generator) stops the transfer and keeps what was downloaded
    for the next pull to resume.
    """
    env = os.environ if env is None else env
    cancel = cancel if cancel is not None else threading.Event()
    parse_name(ref)
    yield Progress("pulling manifest")
    endpoint = hub_endpoint(env)
    try:
        plan = plan_pull(ref, registry, env)
        if plan.register and registry is not None and not user_file_in_use(registry, env):
            paths = ", ".join(str(p) for p in registry.paths)
            raise PullRefused(
                f"pull model manifest: the server reads its models from {paths} only, so a"
                f" pulled {plan.name} could not be served; restart it without --registry"
                f" (or add {user_registry_path(env)} to MLXD_REGISTRY)"
            )
        for path in plan.local:
            if resolve_local(str(path), env=env) is None:
                raise PullNotFound(f"pull model manifest: {path} does not exist")
    except Exception as exc:
        raise _explain(exc, "pull model manifest", endpoint) from exc

    offline = hub_offline(env)
    token = _token(env)
    cache = hub_cache_dir(env).expanduser()
    with _hub_session(offline):
        try:
            if offline:
                manifests = [_offline_manifest(r, cache, env) for r in plan.hub]
            else:
                api = HfApi(endpoint=endpoint, token=token)
                manifests = [_manifest(r, api, cache, endpoint) for r in plan.hub]
        except Exception as exc:
            raise _explain(exc, "pull model manifest", endpoint) from exc
        jobs = [_plan_job(m, f) for m in manifests for f in m.files]
        _check_space(jobs, cache)

        downloaded: list[_Job] = []
        shown: set[str] = set()  # one series per digest: a file the draft shares with the
        # target (its tokenizer) is fetched into each repo, its bar drawn once
        for job in jobs:
            if cancel.is_set():
                raise PullCancelled()
            fetching = job.state == "download"
            moves = _transfer(job, endpoint, token, cancel)
            if job.digest in shown:
                for _ in moves:
                    pass
            else:
                shown.add(job.digest)
                yield from moves
            if fetching and job.state == "download":
                downloaded.append(job)

        yield Progress("verifying sha256 digest")
        try:
            for job in downloaded:
                _verify_and_commit(job, cancel)
            for job in jobs:
                if job.state == "link":
                    _link(job)
        except Exception as exc:
            raise _explain(exc, "verify", endpoint) from exc

        yield Progress("writing manifest")
        try:
            for manifest in manifests:
                _write_ref(manifest)
            if plan.register:
                fields = {**plan.keep, **_registration(manifests[0])}
                set_entry(plan.name, fields, path=user_registry_path(env))
        except Exception as exc:
            raise _explain(exc, "write manifest", endpoint) from exc
    yield Progress("success")


# -- delete and copy ------------------------------------------------------------------------


@dataclass(frozen=True)
class Removal:
    """What :func:`delete_model` did."""

    name: str
    entry_removed: bool  # taken out of the user registry file
    revisions: tuple[str, ...]  # hub cache revisions deleted
    freed: int  # bytes
    kept: tuple[str, ...]  # repos left alone because another entry still uses them


def _hub_refs(entry: ModelEntry, env: Mapping[str, str]) -> list[HubRef | Path]:
    """Where the entry's files come from: its target, its draft, then its adapters (a hub
    repo, pinned where the path is into the hub cache, or a local path)."""
    models = [_cache_ref(ref, env) for ref in (entry.target, entry.draft) if ref]
    adapters = [_cache_ref(a.ref, env) for a in (*entry.adapters, *entry.draft_adapters)]
    return models + [replace(a, adapter=True) if isinstance(a, HubRef) else a for a in adapters]


def _others(
    entry: ModelEntry, registry: Registry, env: Mapping[str, str], removed: bool
) -> list[ModelEntry]:
    """The entries left once ``entry`` is gone (re-read, so a packaged entry that a removed
    user entry overrode counts again)."""
    if removed:
        try:
            fresh = Registry.load(list(registry.paths), optional=(user_registry_path(env),))
            return [e for e in fresh.entries() if e != entry]
        except RegistryError:
            pass
    return [e for e in registry.entries() if e.key != entry.key]


def delete_model(
    entry: ModelEntry, registry: Registry, env: Mapping[str, str] = os.environ
) -> Removal:
    """Remove a model: its user-registry entry, and its hub-cache files and the adapter
    directories created for it (`prune_adapters`) unless shared.

    An entry in the user registry (``$MLXD_HOME/models.yaml``) is taken out of that file. An
    entry that lives in the packaged registry or a ``--registry`` file cannot be removed from
    there (mlxd does not rewrite those files); deleting its downloaded files instead makes it
    disappear from ``/api/tags`` until it is pulled again. Files are deleted only from the
    hub cache (never a local directory an entry points at), and only revisions no other
    registry entry still uses. Raises :class:`DeleteError`.
    """
    user_file = user_registry_path(env)
    in_user_file = _norm(entry.source) == _norm(user_file)
    if not in_user_file and not files_present(entry, env):
        raise DeleteError(404, f"model '{entry.name}' not found")  # configured, not pulled
    with adapters_lock(env):  # no create is registering an adapter directory pruned here
        removed = remove_entry(entry.name, path=user_file) if in_user_file else False
        others = _others(entry, registry, env, removed)
        pruned = prune_adapters(entry, others, env) if removed else 0

    whole: set[str] = set()  # repos another entry uses at main: keep every revision
    pinned: set[tuple[str, str]] = set()
    users: dict[str, list[str]] = {}  # repo -> the other entries using it
    for other in others:
        for ref in _hub_refs(other, env):
            if isinstance(ref, HubRef):
                key = ref.repo_id.lower()
                users.setdefault(key, []).append(other.name)
                if ref.pinned:
                    pinned.add((key, ref.revision))
                else:
                    whole.add(key)

    cache = hub_cache_dir(env).expanduser()
    try:
        scan = scan_cache_dir(cache)
        cached = {r.repo_id.lower(): r for r in scan.repos if r.repo_type == "model"}
    except (CacheNotFound, ValueError, OSError):
        scan, cached = None, {}

    doomed: set[str] = set()
    wipe: list[Path] = []  # repo folders to remove entirely
    kept: list[str] = []
    hub_refs = [r for r in _hub_refs(entry, env) if isinstance(r, HubRef)]
    for ref in hub_refs:
        key = ref.repo_id.lower()
        if key in whole:
            kept.append(ref.repo_id)
            continue
        repo = cached.get(key)
        storage = cache / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
        revisions = {r.commit_hash for r in repo.revisions} if repo is not None else set()
        wanted = {ref.revision} if ref.pinned else set(revisions)
        still_used = {c for (k, c) in pinned if k == key}
        if wanted & still_used:
            kept.append(ref.repo_id)
        doomed |= (wanted & revisions) - still_used
        if not ref.pinned and not still_used and storage.is_dir():
            wipe.append(storage)  # also partial downloads and a repo scan found corrupt

    freed = 0
    if doomed and scan is not None:
        strategy = scan.delete_revisions(*sorted(doomed))
        freed = strategy.expected_freed_size
        strategy.execute()
    for storage in wipe:
        shutil.rmtree(storage, ignore_errors=True)
    deleted = tuple(sorted(doomed))

    if not in_user_file and not doomed and not wipe:
        if kept:
            sharers = sorted({n for r in kept for n in users.get(r.lower(), [])})
            raise DeleteError(
                400,
                f"model '{entry.name}' is defined in {entry.source}, which mlxd does not edit,"
                f" and its files are also used by {', '.join(repr(n) for n in sharers)};"
                " remove it from that file instead",
            )
        if hub_refs:
            raise DeleteError(404, f"model '{entry.name}' not found")
        raise DeleteError(
            400,
            f"model '{entry.name}' is defined in {entry.source} and points at local files"
            " that mlxd does not manage; remove it from that file instead",
        )
    return Removal(entry.name, removed, deleted, freed + pruned, tuple(kept))


def copy_model(
    entry: ModelEntry,
    destination: str,
    registry: Registry | None = None,
    env: Mapping[str, str] = os.environ,
) -> str:
    """Register ``destination`` in the user registry with ``entry``'s fields; the display name.
    A model it replaces (found in ``registry``) keeps its name as stored, whatever its case
    in ``destination``, and leaves no adapter files only it used."""
    name = parse_name(destination).display
    fields = {**entry_fields(entry), "modified_at": written_now()}  # a new model, as Ollama's
    with adapters_lock(env):
        replaced = stored_entry(name, registry, env) if registry is not None else None
        if replaced is not None:
            name = replaced.name
        set_entry(name, fields, path=user_registry_path(env))
        if registry is not None and replaced is not None:
            prune_replaced(replaced, registry, env)
    return name
