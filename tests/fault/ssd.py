"""Helpers for the SSD-tier fault tests: rows written behind the store's back, and the state
of a cache directory as SQLite and the file system see it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from mlxd.engine.ssd_store import DB_NAME, VALUE_NAME

MiB = 2**20


def put_row(
    directory: Path, key: Any, *, mode: Any, value: Any = None, filename: Any = None,
    size: Any = 0, raw: Any = 1, access_time: float | None = None,
) -> None:  # fmt: skip
    """Insert (or replace) a Cache row with sqlite3 directly, as an attacker or a bug would."""
    now = time.time() if access_time is None else access_time
    con = sqlite3.connect(directory / DB_NAME, timeout=30)
    try:
        with con:
            con.execute("DELETE FROM Cache WHERE key = ?", (key,))
            con.execute(
                "INSERT INTO Cache (key, raw, store_time, expire_time, access_time,"
                " access_count, tag, size, mode, filename, value)"
                " VALUES (?, ?, ?, NULL, ?, 0, NULL, ?, ?, ?, ?)",
                (key, raw, now, now, size, mode, filename, value),
            )
    finally:
        con.close()


def sql(directory: Path, statement: str, *args: Any) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(directory / DB_NAME, timeout=30)
    try:
        with con:
            return con.execute(statement, args).fetchall()
    finally:
        con.close()


def value_files(directory: Path) -> dict[str, int]:
    """Every value file under the directory (relative name -> size)."""
    return {
        p.relative_to(directory).as_posix(): p.stat().st_size
        for p in directory.rglob("*.val")
        if p.is_file()
        if VALUE_NAME.fullmatch(p.relative_to(directory).as_posix())
    }


def referenced(directory: Path) -> set[str]:
    return {r[0] for r in sql(directory, "SELECT filename FROM Cache WHERE filename IS NOT NULL")}


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every path under root, symlinks unfollowed."""
    out: dict[str, tuple[int, int]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out
