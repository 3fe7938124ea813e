"""The SSD tier's directory: diskcache holding bytes only, and trusting nothing it reads back.

The cache directory outlives the process and anyone who can write to it can craft its
database, so what diskcache would do with a row is narrowed to what this tier writes:

- values are bytes, kept inline (small) or in a value file ``ab/cd/<28 hex>.val``; a row of
  any other kind (a pickle, text, a file name of another shape) is a :class:`BadEntry`,
  never unpickled, opened or deleted, and a name that leaves the directory is never used;
- on open the database is scrubbed (rows and settings this tier never writes are dropped,
  its own triggers and counters rebuilt) and a database SQLite cannot read is moved aside
  (``cache.db.damaged``): the tier comes up empty rather than keeping the daemon down;
- value files no row refers to (a process killed between writing a file and its row) are
  reclaimed: all of them when no other process has the directory open (an flock on
  ``writer.lock`` tells), else those older than :data:`ORPHAN_GRACE_S`; the ones left count
  against the size limit;
- a directory that cannot be used (a file, a dangling symlink to an unmounted disk, a
  symlink loop, no permission) is a :class:`StoreUnavailable` with the reason to log.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import DEFAULT_SETTINGS, METADATA, MODE_BINARY, MODE_RAW, UNKNOWN

log = logging.getLogger(__name__)

DB_NAME = "cache.db"
LOCK_NAME = "writer.lock"
MIN_FILE_SIZE = 2**15  # values from this size on get a file of their own (diskcache's default)
ORPHAN_GRACE_S = 600.0  # an unreferenced file this young may be another process's write
_HEX = "[0-9a-f]"
VALUE_NAME = re.compile(rf"{_HEX}{{2}}/{_HEX}{{2}}/{_HEX}{{28}}\.val")
_VALUE_GLOB = f"{_HEX * 2}/{_HEX * 2}/{_HEX * 28}.val"  # the same, for SQLite's GLOB
_SUBDIR = re.compile(rf"{_HEX}{{2}}")


class StoreUnavailable(Exception):
    """The directory cannot hold the SSD tier; the message says why."""


class BadEntry(Exception):
    """A row that does not describe a value this store wrote."""


@dataclass(frozen=True)
class Parts:
    """One value handed over as the buffers it is made of, written to its file one after
    another: a K/V block is megabytes, and joining it into one `bytes` first would copy it
    (holding the GIL) only to write it out."""

    chunks: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def join(self) -> bytes:
        return b"".join(self.chunks)


class BytesDisk(diskcache.Disk):
    """diskcache's serializer narrowed to str keys and bytes values, and to value files inside
    the cache directory; everything else is a :class:`BadEntry` (reads) or a TypeError."""

    def __init__(self, directory: str, min_file_size: int = MIN_FILE_SIZE, **_: Any) -> None:
        # Unknown disk_* settings (from a crafted database) are ignored, not a crash.
        super().__init__(directory, min_file_size=int(min_file_size))
        self._root = os.path.realpath(directory)

    def put(self, key: Any) -> tuple[Any, bool]:
        if type(key) is not str:
            raise TypeError("the SSD tier's keys are str")
        return key, True

    def get(self, key: Any, raw: bool) -> Any:
        if raw and type(key) is str:
            return key
        raise BadEntry("a key this store did not write")

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[Any, ...]:
        if type(value) is Parts and not read:
            if value.nbytes < self.min_file_size:
                return super().store(value.join(), read, key)
            filename, full_path = self.filename(key, value)
            try:
                size = self._write(full_path, iter(value.chunks), "xb")  # writes run GIL-free
            except BaseException:
                with contextlib.suppress(OSError):  # a full disk's empty or partial file
                    os.unlink(full_path)
                raise
            return size, MODE_BINARY, filename, None
        if type(value) is not bytes or read:
            raise TypeError("the SSD tier stores bytes")
        return super().store(value, read, key)

    def filename(self, key: Any = UNKNOWN, value: Any = UNKNOWN) -> tuple[str, str]:
        """A fresh value file name, refused when a symlink stands in for its subdirectory."""
        name, full_path = super().filename(key, value)
        for sub in (name[:2], name[:5]):
            path = os.path.join(self._root, sub)
            if os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        return name, full_path

    def fetch(self, mode: int, filename: Any, value: Any, read: bool) -> bytes:
        if mode == MODE_RAW and isinstance(value, bytes | memoryview) and not read:
            return bytes(value)
        path = self.value_path(filename)
        if mode != MODE_BINARY or value is not None or path is None or read:
            raise BadEntry(f"a row of mode {mode!r} naming {filename!r}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with open(fd, "rb") as f:
                return f.read()
        except OSError as exc:
            raise BadEntry(f"value file {filename}: {exc.strerror or exc}") from exc

    def remove(self, file_path: Any) -> None:
        """Delete a value file and its emptied subdirectories; nothing else, ever."""
        path = self.value_path(file_path)
        if path is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(path)
        parent = os.path.dirname(path)
        for directory in (parent, os.path.dirname(parent)):
            try:
                os.rmdir(directory)
            except OSError:
                return

    def value_path(self, filename: Any) -> str | None:
        """The file's path if ``filename`` is one this store makes and its directories are
        real ones inside the cache directory (not symlinks out of it)."""
        if type(filename) is not str or VALUE_NAME.fullmatch(filename) is None:
            return None
        for sub in (filename[:2], filename[:5]):  # the root itself was resolved once
            try:
                if not stat.S_ISDIR(os.lstat(os.path.join(self._root, sub)).st_mode):
                    return None  # a symlink (or anything else) in place of a subdirectory
            except OSError:
                return None
        return os.path.join(self._root, filename)


@dataclass(frozen=True)
class Reclaimed:
    """What opening the store cleaned up."""

    rows_dropped: int = 0  # database rows this store never writes
    damaged: str = ""  # why the database was moved aside, if it was
    orphans: int = 0  # value files no row referred to, deleted
    orphan_bytes: int = 0
    orphan_bytes_left: int = 0  # unreferenced but young, with another process about


@dataclass
class Store:
    """An open store: the diskcache, the lock that marks this process as a user of the
    directory, and what was cleaned up when it opened."""

    cache: diskcache.Cache
    lock_fd: int
    reclaimed: Reclaimed

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cache.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


# -- opening -----------------------------------------------------------------------------------


def _why_unusable(directory: Path, exc: OSError) -> str:
    if directory.is_symlink():
        target = os.readlink(directory)
        if exc.errno == errno.ELOOP or _is_loop(directory):
            return f"{directory} is a symlink loop"
        if not directory.is_dir():
            return (
                f"{directory} is a symlink to {target}, which is unusable:"
                f" {exc.strerror or exc} (is its disk unmounted?)"
            )
    if exc.errno == errno.ELOOP:
        return f"{directory} is a symlink loop"
    if directory.exists() and not directory.is_dir():
        return f"{directory} is not a directory"
    return f"{directory}: {exc.strerror or exc}"


def _is_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def usable_directory(directory: Path) -> Path:
    """``directory``, created if missing, once it is a directory this process can write to."""
    try:
        if not os.path.lexists(directory):
            directory.mkdir(parents=True)
        st = os.stat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        probe = directory / f".probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StoreUnavailable(_why_unusable(directory, exc)) from exc
    return directory


def _lock(directory: Path) -> tuple[int, bool]:
    """A descriptor holding a shared flock on ``writer.lock``, and whether no other process
    held one (then this one briefly held it exclusively: every orphan is reclaimable)."""
    path = directory / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:
        fcntl.flock(fd, fcntl.LOCK_SH)
        alone = False
    return fd, alone


def _move_aside(directory: Path, why: str) -> None:
    """Keep the unreadable database for inspection (the latest one only) and start afresh."""
    db = directory / DB_NAME
    with contextlib.suppress(OSError):
        os.replace(db, directory / f"{DB_NAME}.damaged")
    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(OSError):
            os.unlink(directory / f"{DB_NAME}{suffix}")
    log.error("prefix cache: %s is damaged (%s); moved to %s.damaged", db, why, db)


# SQLite's errors about access to a database (locks, permissions, a full disk, a write the OS
# refused) rather than its contents: a full disk at startup turns the tier off for the run and
# must not discard what it holds. A failed *read* (SQLITE_IOERR_SHORT_READ) is damage.
ACCESS_ERRORS = (
    "SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_PERM",
    "SQLITE_FULL", "SQLITE_NOMEM", "SQLITE_IOERR_WRITE", "SQLITE_IOERR_FSYNC",
    "SQLITE_IOERR_DIR_FSYNC", "SQLITE_IOERR_TRUNCATE", "SQLITE_IOERR_SHM", "SQLITE_IOERR_NOMEM",
    "SQLITE_IOERR_LOCK", "SQLITE_IOERR_ACCESS",
)  # fmt: skip
ACCESS_WORDS = ("locked", "busy", "unable to open", "readonly", "disk is full")


def _temporary(exc: sqlite3.Error) -> bool:
    """An error about access to the database rather than its contents."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    name = getattr(exc, "sqlite_errorname", None) or ""
    return name.startswith(ACCESS_ERRORS) or any(w in str(exc).lower() for w in ACCESS_WORDS)


def _scrub(db: Path) -> tuple[int, set[str]]:
    """Drop what this store never writes from an existing database; (rows dropped, the value
    files the remaining rows refer to)."""
    if not os.path.lexists(db):
        return 0, set()
    if not stat.S_ISREG(os.lstat(db).st_mode):
        raise sqlite3.DatabaseError(f"{DB_NAME} is not a regular file")
    con = sqlite3.connect(db, timeout=10, isolation_level=None)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"Cache", "Settings"} <= tables:
            raise sqlite3.DatabaseError("not a diskcache database")
        con.execute("BEGIN IMMEDIATE")
        # diskcache re-creates its triggers and indexes on open; crafted ones must not stay.
        for kind in ("trigger", "view"):
            rows = con.execute("SELECT name FROM sqlite_master WHERE type=?", (kind,))
            for (name,) in rows.fetchall():
                quoted = '"' + str(name).replace('"', '""') + '"'
                con.execute(f"DROP {kind.upper()} {quoted}")
        known = [*DEFAULT_SETTINGS, *METADATA]
        marks = ",".join("?" * len(known))
        dropped = con.execute(f"DELETE FROM Settings WHERE key NOT IN ({marks})", known).rowcount
        dropped += con.execute(
            "DELETE FROM Cache WHERE NOT ("
            " raw = 1 AND typeof(key) = 'text' AND typeof(size) = 'integer' AND size >= 0"
            " AND ((mode = ? AND filename IS NULL AND typeof(value) = 'blob')"
            "  OR (mode = ? AND value IS NULL AND typeof(filename) = 'text'"
            "      AND filename GLOB ?)))",
            (MODE_RAW, MODE_BINARY, _VALUE_GLOB),
        ).rowcount
        # Two rows naming one file: deleting either would take the other's value; the first
        # (diskcache never reuses a name, so a later one is not its own) is kept.
        dropped += con.execute(
            "DELETE FROM Cache WHERE filename IS NOT NULL AND rowid NOT IN"
            " (SELECT MIN(rowid) FROM Cache WHERE filename IS NOT NULL GROUP BY filename)"
        ).rowcount
        for key, total in (("count", "COUNT(*)"), ("size", "COALESCE(SUM(size), 0)")):
            update = f"UPDATE Settings SET value = (SELECT {total} FROM Cache) WHERE key = ?"
            con.execute(update, (key,))
        con.execute("UPDATE Settings SET value = 0 WHERE key IN ('hits', 'misses')")
        con.execute("COMMIT")
        rows = con.execute("SELECT filename FROM Cache WHERE mode = ?", (MODE_BINARY,))
        files = {r[0] for r in rows}
    finally:
        con.close()
    return dropped, files


def _value_files(directory: Path) -> list[tuple[str, os.stat_result]]:
    """(name relative to the directory, lstat) of every file shaped like a value file."""
    found: list[tuple[str, os.stat_result]] = []
    for a in os.scandir(directory):
        if not (_SUBDIR.fullmatch(a.name) and a.is_dir(follow_symlinks=False)):
            continue
        for b in os.scandir(a.path):
            if not (_SUBDIR.fullmatch(b.name) and b.is_dir(follow_symlinks=False)):
                continue
            for f in os.scandir(b.path):
                name = f"{a.name}/{b.name}/{f.name}"
                if VALUE_NAME.fullmatch(name) and f.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        found.append((name, f.stat(follow_symlinks=False)))
    return found


def _reclaim(
    directory: Path, disk: BytesDisk, listed: list[tuple[str, os.stat_result]],
    referenced: set[str], alone: bool,
) -> tuple[int, int, int]:  # fmt: skip
    """Delete unreferenced value files; (files deleted, their bytes, bytes left)."""
    cutoff = time.time() - ORPHAN_GRACE_S
    count = freed = left = 0
    for name, st in listed:
        if name in referenced:
            continue
        if alone or st.st_mtime < cutoff:
            disk.remove(name)
            count += 1
            freed += st.st_size
        else:
            left += st.st_size
    return count, freed, left


def _open_cache(directory: Path, size_limit: int) -> diskcache.Cache:
    settings = {
        **DEFAULT_SETTINGS,
        # diskcache's defaults (1 GiB, least-recently-*stored*) do not fit a KV cache.
        "size_limit": size_limit,
        "eviction_policy": "least-recently-used",
        "cull_limit": 16,
        "statistics": 0,
        "tag_index": 0,
        "disk_min_file_size": MIN_FILE_SIZE,
    }
    return diskcache.Cache(str(directory), disk=BytesDisk, **settings)


def open_store(directory: Path, size_limit: int) -> Store:
    """Open (or create) the store in ``directory``; raises :class:`StoreUnavailable`."""
    directory = usable_directory(directory)
    try:
        lock_fd, alone = _lock(directory)
    except OSError as exc:
        raise StoreUnavailable(f"{directory / LOCK_NAME}: {exc.strerror or exc}") from exc
    try:
        return _open_locked(directory, size_limit, lock_fd, alone)
    except OSError as exc:
        os.close(lock_fd)
        raise StoreUnavailable(f"{directory}: {exc.strerror or exc}") from exc
    except BaseException:
        os.close(lock_fd)
        raise


def _open_locked(directory: Path, size_limit: int, lock_fd: int, alone: bool) -> Store:
    listed = _value_files(directory)  # before the rows: a file is written before its row
    damaged = ""
    try:
        dropped, referenced = _scrub(directory / DB_NAME)
    except sqlite3.Error as exc:
        if _temporary(exc):
            raise StoreUnavailable(f"{directory / DB_NAME}: {exc}") from exc
        damaged = str(exc) or type(exc).__name__
        _move_aside(directory, damaged)
        dropped, referenced = 0, set()
    disk = BytesDisk(str(directory))
    orphans, freed, left = _reclaim(directory, disk, listed, referenced, alone)
    try:
        cache = _open_cache(directory, max(0, size_limit - left))
    except sqlite3.Error as exc:
        if _temporary(exc) or damaged:
            raise StoreUnavailable(f"{directory / DB_NAME}: {exc}") from exc
        damaged = str(exc)
        _move_aside(directory, damaged)
        cache = _open_cache(directory, max(0, size_limit - left))
    if alone:
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # others may share the directory from now on
    if dropped or orphans:
        log.warning(
            "prefix cache: %s: dropped %d foreign database rows, reclaimed %d orphaned files"
            " (%d bytes)", directory, dropped, orphans, freed,
        )  # fmt: skip
    return Store(cache, lock_fd, Reclaimed(dropped, damaged, orphans, freed, left))
