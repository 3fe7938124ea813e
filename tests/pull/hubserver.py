"""A local stand-in for the Hugging Face hub, enough for huggingface_hub 2.x to pull from.

It serves model repositories held in memory (copied from directories such as the tiny test
models) over the endpoints huggingface_hub calls:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: ``model_info``; with
  ``?blobs=true`` (``files_metadata=True``) each sibling carries ``size``, ``blobId`` and, for
  LFS files, ``lfs: {sha256, size, pointerSize}``;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: ``list_repo_tree``, each
  file with ``type``, ``oid``, ``size``, ``path`` and ``lfs: {oid, size, pointerSize}``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the file, with the hub's headers:
  ``X-Repo-Commit``, ``ETag`` (quoted sha256 for LFS files, git blob sha1 for the others),
  ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Content-Length``, ``Accept-Ranges`` and
  ``Range`` requests answered with ``206``/``Content-Range``;
- errors as the hub sends them: ``404`` with ``X-Error-Code: RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``.

Hooks for tests: :meth:`HubServer.corrupt` serves bytes that differ from the advertised
hashes, :meth:`HubServer.cut` drops the connection after N bytes (and can fail the next
requests with a status), :attr:`HubServer.lfs_redirect` sends LFS downloads to a "CDN"
on another origin (``localhost`` instead of ``127.0.0.1``), and every request is recorded
(:meth:`HubServer.gets`, :attr:`HubServer.requests`).

A hostile hub, for the pull's defences: :meth:`HubServer.serve_etag` answers with another
``ETag`` (e.g. an absolute path or ``../..``) once a file has been fetched, and
:meth:`HubServer.list_as` lists a file under another name too (``../x.json``, ``/abs.json``, a
NUL byte) or with other hashes, while still serving it under that name.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubFile", "HubServer", "Request", "git_oid"]

POINTER_SIZE = 134  # what an LFS pointer file of a typical size takes in git
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.gguf", "tokenizer.json")
DATE = "2026-01-02T03:04:05.000Z"


def git_oid(data: bytes) -> str:
    """The git blob sha1 of ``data`` (what the hub reports as a file's ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def oid(self) -> str:
        return git_oid(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.oid


@dataclass
class _Repo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        if revision in self.commits:
            return revision
        return None


@dataclass(frozen=True)
class _Listed:
    path: str  # the real file
    sha256: str | None
    oid: str | None


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # decoded path, without the query
    headers: Mapping[str, str]  # lower-case names

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


@dataclass
class _Cut:
    after: int
    times: int
    then_status: int | None
    then_times: int


class HubServer:
    """A threaded HTTP server on 127.0.0.1 serving repos the way the hub does."""

    def __init__(self, lfs_patterns: Iterable[str] = LFS_PATTERNS) -> None:
        self.lfs_patterns = tuple(lfs_patterns)
        self.lfs_redirect = False
        self.stall_api = 0.0  # seconds the model-info API waits before it answers
        self.stall_body = 0.0  # seconds a file body waits after its first 16 KiB
        self._repos: dict[str, _Repo] = {}
        self._corrupt: set[tuple[str, str]] = set()
        self._cuts: dict[tuple[str, str], _Cut] = {}
        self._etags: dict[tuple[str, str], tuple[str, int]] = {}  # -> (etag, true ones left)
        self._listed: dict[tuple[str, str], _Listed] = {}  # (repo, listed name) -> what
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    # -- lifecycle --

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- content --

    def add_repo(
        self,
        repo_id: str,
        source: Path | Mapping[str, bytes],
        *,
        revision: str = "main",
    ) -> str:
        """Serve ``source`` (a directory, copied recursively, or path -> bytes) as ``repo_id``
        at ``revision`` (a branch or tag); returns the new commit's sha."""
        if isinstance(source, Path):
            files = {
                p.relative_to(source).as_posix(): p.read_bytes()
                for p in sorted(source.rglob("*"))
                if p.is_file()
            }
        else:
            files = dict(source)
        content = {
            path: HubFile(path, data, any(fnmatch.fnmatch(path, pat) for pat in self.lfs_patterns))
            for path, data in files.items()
        }
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(repo_id.encode())
        for path in sorted(content):
            digest.update(f"{path}\0{content[path].oid}\n".encode())
        commit = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id.lower(), _Repo(repo_id))
            repo.commits[commit] = content
            repo.refs[revision] = commit
        return commit

    def file(self, repo_id: str, path: str, revision: str = "main") -> HubFile:
        repo = self._repos[repo_id.lower()]
        commit = repo.resolve(revision)
        assert commit is not None
        return repo.commits[commit][path]

    # -- hooks --

    def corrupt(self, repo_id: str, path: str) -> None:
        """Serve ``path`` with one byte changed; listings and headers keep the true hashes."""
        with self._lock:
            self._corrupt.add((repo_id.lower(), path))

    def cut(
        self,
        repo_id: str,
        path: str,
        after: int,
        *,
        times: int = 1,
        then_status: int | None = None,
        then_times: int = 1,
    ) -> None:
        """Drop the connection after ``after`` body bytes on the next ``times`` GETs of
        ``path``; then answer ``then_status`` (e.g. 503) to the next ``then_times`` GETs."""
        with self._lock:
            self._cuts[(repo_id.lower(), path)] = _Cut(after, times, then_status, then_times)

    def serve_etag(self, repo_id: str, path: str, etag: str, *, after: int = 0) -> None:
        """Answer ``etag`` (quoted, as ``ETag`` and ``X-Linked-Etag``) for ``path`` after
        ``after`` responses with the true one."""
        with self._lock:
            self._etags[(repo_id.lower(), path)] = (etag, after)

    def list_as(
        self,
        repo_id: str,
        path: str,
        *,
        name: str | None = None,
        sha256: str | None = None,
        oid: str | None = None,
    ) -> None:
        """List ``path`` also as ``name`` (its bytes are served under that name too), or with
        the given hashes in place of its true ones."""
        listed = name if name is not None else path
        with self._lock:
            self._listed[(repo_id.lower(), listed)] = _Listed(path, sha256, oid)

    def gets(self, suffix: str = "") -> list[Request]:
        """Recorded file downloads (GETs of ``resolve``/CDN URLs) whose path ends with suffix."""
        with self._lock:
            return [
                r
                for r in self.requests
                if r.method == "GET"
                and ("/resolve/" in r.path or r.path.startswith("/cdn/"))
                and r.path.endswith(suffix)
            ]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # -- request handling (called from the handler) --

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _repo(self, repo_id: str) -> _Repo | None:
        with self._lock:
            return self._repos.get(repo_id.lower())

    def _body_for(self, repo: _Repo, f: HubFile) -> bytes:
        if (repo.repo_id.lower(), f.path) not in self._corrupt:
            return f.data
        data = bytearray(f.data)
        data[len(data) // 2] ^= 0xFF
        return bytes(data)

    def _take_cut(self, repo: _Repo, path: str) -> tuple[str, int] | None:
        """("cut", after) or ("status", code) for this GET, consuming the hook."""
        with self._lock:
            cut = self._cuts.get((repo.repo_id.lower(), path))
            if cut is None:
                return None
            if cut.times > 0:
                cut.times -= 1
                return ("cut", cut.after)
            if cut.then_status is not None and cut.then_times > 0:
                cut.then_times -= 1
                return ("status", cut.then_status)
            return None

    def _etag(self, repo: _Repo, f: HubFile) -> str:
        with self._lock:
            hostile = self._etags.get((repo.repo_id.lower(), f.path))
            if hostile is None:
                return f.etag
            etag, left = hostile
            if left > 0:
                self._etags[(repo.repo_id.lower(), f.path)] = (etag, left - 1)
                return f.etag
            return etag

    def _listing(
        self, repo: _Repo, files: Mapping[str, HubFile]
    ) -> list[tuple[str, HubFile, str, str]]:
        """(listed name, file, listed sha256, listed oid) of every file, hostile ones included."""
        with self._lock:
            listed = {k[1]: v for k, v in self._listed.items() if k[0] == repo.repo_id.lower()}
        out = [(p, f, f.sha256, f.oid) for p, f in sorted(files.items())]
        for name, v in sorted(listed.items()):
            f = files.get(v.path)
            if f is None:
                continue
            out = [o for o in out if o[0] != name]
            out.append((name, f, v.sha256 or f.sha256, v.oid or f.oid))
        return out

    def _aliased(self, repo: _Repo, files: Mapping[str, HubFile], name: str) -> HubFile | None:
        with self._lock:
            listed = self._listed.get((repo.repo_id.lower(), name))
        return files.get(listed.path) if listed is not None else files.get(name)

    def _by_sha(self, sha: str) -> tuple[_Repo, HubFile] | None:
        with self._lock:
            for repo in self._repos.values():
                for files in repo.commits.values():
                    for f in files.values():
                        if f.lfs and f.sha256 == sha:
                            return repo, f
        return None


_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)$")


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "hubserver/1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        # -- plumbing --

        def _send(
            self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None
        ) -> None:
            self.send_response(status)
            sent = {k.lower() for k in (headers or {})}
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if "content-length" not in sent:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _json(self, obj: Any) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _error(self, status: int, code: str | None, message: str, commit: str = "") -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers)

        def _split_repo(self, parts: list[str]) -> tuple[str, list[str]]:
            """Repo id (one or two segments) and the rest of the path segments."""
            if len(parts) >= 2 and hub._repo(f"{parts[0]}/{parts[1]}") is not None:
                return f"{parts[0]}/{parts[1]}", parts[2:]
            if parts and hub._repo(parts[0]) is not None:
                return parts[0], parts[1:]
            return "/".join(parts[:2]), parts[2:]

        # -- methods --

        def do_HEAD(self) -> None:
            self._dispatch()

        def do_GET(self) -> None:
            self._dispatch()

        def _dispatch(self) -> None:
            url = urlsplit(self.path)
            raw_parts = [p for p in url.path.split("/") if p]
            parts = [unquote(p) for p in raw_parts]
            hub._record(
                Request(
                    self.command,
                    unquote(url.path),
                    {k.lower(): v for k, v in self.headers.items()},
                )
            )
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if parts[:2] == ["api", "models"] and self.command == "GET":
                self._api(parts[2:], query)
            elif parts[:1] == ["cdn"] and len(parts) == 2:
                found = hub._by_sha(parts[1])
                if found is None:
                    self._error(404, None, "not found")
                else:
                    repo, f = found
                    self._file(repo, f, "", cdn=True)
            else:
                repo_id, rest = self._split_repo(parts)
                if len(rest) >= 3 and rest[0] == "resolve":
                    self._resolve(repo_id, rest[1], "/".join(rest[2:]))
                else:
                    self._send(404, b"Not Found", {"Content-Type": "text/plain"})

        # -- api --

        def _api(self, parts: list[str], query: Mapping[str, str]) -> None:
            if hub.stall_api:
                time.sleep(hub.stall_api)
            repo_id, rest = self._split_repo(parts)
            repo = hub._repo(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return
            revision, kind, path = "main", "info", ""
            if rest[:1] == ["revision"] and len(rest) >= 2:
                revision = "/".join(rest[1:])
            elif rest[:1] == ["tree"] and len(rest) >= 2:
                kind, revision, path = "tree", rest[1], "/".join(rest[2:])
            elif rest:
                self._error(404, None, "Not Found")
                return
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            files = repo.commits[commit]
            if kind == "info":
                self._json(self._info(repo, commit, files, query.get("blobs") == "true"))
            else:
                self._tree(commit, files, path, query)

        def _info(
            self, repo: _Repo, commit: str, files: Mapping[str, HubFile], blobs: bool
        ) -> dict[str, Any]:
            siblings: list[dict[str, Any]] = []
            for path, f, sha256, oid in hub._listing(repo, files):
                item: dict[str, Any] = {"rfilename": path}
                if blobs:
                    item["size"] = f.size
                    item["blobId"] = oid
                    if f.lfs:
                        item["lfs"] = {
                            "sha256": sha256,
                            "size": f.size,
                            "pointerSize": POINTER_SIZE,
                        }
                siblings.append(item)
            author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
            return {
                "_id": hashlib.md5(repo.repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": author,
                "sha": commit,
                "lastModified": DATE,
                "createdAt": DATE,
                "private": False,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "library_name": "mlx",
                "tags": ["mlx", "safetensors"],
                "siblings": siblings,
                "usedStorage": sum(f.size for f in files.values()),
            }

        def _tree(
            self, commit: str, files: Mapping[str, HubFile], path: str, query: Mapping[str, str]
        ) -> None:
            recursive = query.get("recursive", "false").lower() == "true"
            expand = query.get("expand", "false").lower() == "true"
            prefix = f"{path.strip('/')}/" if path.strip("/") else ""
            under = [p for p in sorted(files) if p.startswith(prefix)]
            if prefix and not under:
                self._error(404, "EntryNotFound", f"{path} does not exist", commit)
                return
            last_commit = {"id": commit, "title": "Upload model", "date": DATE}
            items: list[dict[str, Any]] = []
            dirs: set[str] = set()
            for p in under:
                rel = p[len(prefix) :]
                segments = rel.split("/")
                for i in range(1, len(segments)):
                    d = prefix + "/".join(segments[:i])
                    if (recursive or i == 1) and d not in dirs:
                        dirs.add(d)
                        folder: dict[str, Any] = {
                            "type": "directory",
                            "oid": git_oid(d.encode()),
                            "size": 0,
                            "path": d,
                        }
                        if expand:
                            folder["lastCommit"] = last_commit
                        items.append(folder)
                if not recursive and len(segments) > 1:
                    continue
                f = files[p]
                item: dict[str, Any] = {"type": "file", "oid": f.oid, "size": f.size, "path": p}
                if f.lfs:
                    item["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": POINTER_SIZE}
                if expand:
                    item["lastCommit"] = last_commit
                    item["securityFileStatus"] = {
                        "status": "safe",
                        "avScan": {"virusFound": False, "virusNames": None},
                        "pickleImportScan": None,
                    }
                items.append(item)
            self._json(items)

        # -- files --

        def _resolve(self, repo_id: str, revision: str, path: str) -> None:
            repo = hub._repo(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return
            f = hub._aliased(repo, repo.commits[commit], path)
            if f is None:
                self._error(404, "EntryNotFound", f"{path} does not exist", commit)
                return
            if f.lfs and hub.lfs_redirect:
                location = f"http://localhost:{hub.port}/cdn/{f.sha256}"
                self._send(
                    302,
                    b"",
                    {
                        "Location": location,
                        "X-Repo-Commit": commit,
                        "ETag": f'"{f.oid}"',
                        "X-Linked-Etag": f'"{f.sha256}"',
                        "X-Linked-Size": str(f.size),
                    },
                )
                return
            self._file(repo, f, commit)

        def _file(self, repo: _Repo, f: HubFile, commit: str, cdn: bool = False) -> None:
            etag = hub._etag(repo, f)
            headers = {
                "Content-Type": "application/octet-stream",
                "Accept-Ranges": "bytes",
                "ETag": f'"{etag}"',
            }
            if commit:
                headers["X-Repo-Commit"] = commit
            if f.lfs and not cdn:
                headers["X-Linked-Etag"] = f'"{etag}"'
                headers["X-Linked-Size"] = str(f.size)
            body = hub._body_for(repo, f)
            start, end = 0, len(body) - 1
            status = 200
            wanted = self.headers.get("Range")
            if wanted:
                match = _RANGE_RE.match(wanted.strip())
                if match is None or (not match.group(1) and not match.group(2)):
                    self._send(416, b"", {"Content-Range": f"bytes */{len(body)}"})
                    return
                if match.group(1):
                    start = int(match.group(1))
                    if match.group(2):
                        end = min(int(match.group(2)), len(body) - 1)
                else:  # suffix range: the last N bytes
                    start = max(0, len(body) - int(match.group(2)))
                if start >= len(body) or start > end:
                    self._send(416, b"", {"Content-Range": f"bytes */{len(body)}"})
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
            part = body[start : end + 1]
            headers["Content-Length"] = str(len(part))
            if self.command == "HEAD":
                self._send(status, b"", headers)
                return
            hook = hub._take_cut(repo, f.path)
            if hook is not None and hook[0] == "status":
                self._error(hook[1], None, "Service Unavailable")
                return
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if hook is not None:
                self.wfile.write(part[: hook[1]])
                self.wfile.flush()
                self.close_connection = True  # the client sees a body shorter than announced
                return
            if hub.stall_body and len(part) > 16384:
                self.wfile.write(part[:16384])
                self.wfile.flush()
                time.sleep(hub.stall_body)
                part = part[16384:]
            self.wfile.write(part)

    return Handler
