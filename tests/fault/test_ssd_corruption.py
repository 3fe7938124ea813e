"""Every way the SSD tier's files can be damaged leaves a tier that opens, answers misses for
what it lost, restores exactly what it kept, and stores and reads new entries."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from diskcache.core import MODE_BINARY, MODE_RAW

from mlxd.engine.prefix_cache import PrefixCache, SsdTier
from mlxd.engine.ssd_store import DB_NAME
from tests.cache.blocks import make_block
from tests.cache.test_prefix_cache import assert_same_block
from tests.fault.ssd import MiB, put_row, referenced, sql, value_files

KEYS = [f"{i:064x}" for i in range(10)]


def block(i: int):  # type: ignore[no-untyped-def]
    """Even entries are value files, odd ones live inside the database."""
    return make_block(i, tokens=64 if i % 2 == 0 else 4)


def written(directory: Path) -> None:
    tier = SsdTier(directory, 64 * MiB)
    for i, key in enumerate(KEYS):
        tier.put_async(key, block(i))
    tier.close()


def files_by_key(directory: Path) -> dict[str, Path]:
    rows = sql(directory, "SELECT key, filename FROM Cache WHERE filename IS NOT NULL")
    return {key: directory / name for key, name in rows}


def check_tier(directory: Path, lost: set[str] | None) -> None:
    """Opens; every key is either exact or a miss (`lost`: the keys that must be misses, None
    when any may be); then new entries round-trip and no value file is unreferenced."""
    tier = SsdTier(directory, 64 * MiB)
    try:
        for i, key in enumerate(KEYS):
            got = tier.get(key)
            if got is not None:
                assert_same_block(got, block(i))
            if lost is not None:
                assert (got is None) == (key in lost), key
        for i in range(3):
            tier.put_async(f"{900 + i:064x}", make_block(900 + i))
        tier.flush()
        for i in range(3):
            assert_same_block(tier.get(f"{900 + i:064x}"), make_block(900 + i))
    finally:
        tier.close()
    assert set(value_files(directory)) == referenced(directory)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def empty(path: Path) -> None:
    path.write_bytes(b"")


FILE_DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": truncate,
    "flipped": flip,
    "emptied": empty,
    "deleted": Path.unlink,
    "replaced-by-a-directory": lambda p: (p.unlink(), p.mkdir()),  # type: ignore[func-returns-value]
    "replaced-by-a-symlink": lambda p: (p.unlink(), p.symlink_to("/etc/hostname")),  # type: ignore[func-returns-value]
}


@pytest.mark.parametrize("damage", list(FILE_DAMAGE))
def test_a_damaged_value_file_is_a_miss(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    files = files_by_key(directory)
    victim = KEYS[4]
    FILE_DAMAGE[damage](files[victim])
    check_tier(directory, {victim})
    assert not [k for k, _ in sql(directory, "SELECT key, 1 FROM Cache") if k == victim]
    assert Path("/etc/hostname").exists() or damage != "replaced-by-a-symlink"


def test_damaged_inline_values_are_misses(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    rows = sql(directory, "SELECT key, value FROM Cache WHERE value IS NOT NULL")
    assert len(rows) == 5
    damaged = {}
    for n, (key, value) in enumerate(rows[:4]):
        data = bytearray(value)
        if n % 2:
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01
        damaged[key] = bytes(data)
    for key, data in damaged.items():
        put_row(directory, key, mode=MODE_RAW, value=data)
    check_tier(directory, set(damaged))


def test_garbage_rows_are_misses_and_do_not_stop_the_tier(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    rng = random.Random(5)
    values: list[object] = [None, 0, -1, 2**62, 1.5, "", "x" * 300, b"", b"\x00" * 40, "../x"]
    for n in range(40):
        put_row(
            directory, rng.choice([f"{1000 + n:064x}", n, b"k%d" % n, None]),
            mode=rng.choice([MODE_RAW, MODE_BINARY, 0, 3, 4, 7, None, "2"]),
            value=rng.choice(values), filename=rng.choice(values), size=rng.choice(values),
            raw=rng.choice([1, 0, None, "1"]),
        )  # fmt: skip
    check_tier(directory, set())


DB_DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": truncate,
    "garbage": lambda p: p.write_bytes(os.urandom(8192)),
    "zero-length": empty,
    "zeroed-header": lambda p: p.write_bytes(bytes(100) + p.read_bytes()[100:]),
    "flipped-pages": lambda p: p.write_bytes(
        bytes(b ^ 0x5A if i > 4096 and i % 7 == 0 else b for i, b in enumerate(p.read_bytes()))
    ),
    "a-directory": lambda p: (p.unlink(), p.mkdir()),  # type: ignore[func-returns-value]
    "another-sqlite-db": lambda p: (
        p.unlink(),
        __import__("sqlite3").connect(p).execute("CREATE TABLE t (x)").connection.commit(),
    ),  # type: ignore[func-returns-value]
}


@pytest.mark.parametrize("damage", list(DB_DAMAGE))
def test_a_damaged_database_comes_up_empty_and_working(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    db = directory / DB_NAME
    for suffix in ("-wal", "-shm"):  # a clean close leaves everything in the main file
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    DB_DAMAGE[damage](db)
    check_tier(directory, None)
    assert (directory / f"{DB_NAME}.damaged").exists() or damage == "zero-length"


def test_a_database_that_is_a_symlink_is_not_written_through(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    elsewhere = tmp_path / "elsewhere.db"
    (directory / DB_NAME).rename(elsewhere)
    (directory / DB_NAME).symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    check_tier(directory, set(KEYS))
    assert elsewhere.read_bytes() == before
    assert not (directory / DB_NAME).is_symlink()


def test_a_damaged_database_in_the_daemon_cache_does_not_lose_the_ram_tier(
    tmp_path: Path,
) -> None:
    """The facade: a damaged database costs the SSD contents, never the process."""
    directory = tmp_path / "ssd"
    written(directory)
    (directory / DB_NAME).write_bytes(b"\x00not a database\x00" * 64)
    cache = PrefixCache(64 * MiB, directory, 64 * MiB)
    try:
        assert cache.ssd is not None and cache.snapshot()["ssd"] == "on"
        snap = cache.snapshot()
        assert snap["ssd_damaged_db"] and snap["ssd_orphans_reclaimed"] == 5
    finally:
        cache.close()
    assert value_files(directory) == {}


FULL_DISK_OPEN = """
import resource, signal, sys
from pathlib import Path
from mlxd.engine.prefix_cache import PrefixCache
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # no file may grow
cache = PrefixCache(1 << 26, Path(sys.argv[1]), 1 << 26)
print(cache.ssd_off)
cache.close()
"""


def test_a_disk_with_no_room_turns_the_tier_off_and_keeps_what_it_holds(tmp_path: Path) -> None:
    """A full disk at startup is a condition of the run, not damage: the database and its
    value files stay for the next start."""
    import subprocess
    import sys

    directory = tmp_path / "ssd"
    written(directory)
    files = value_files(directory)
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK_OPEN, str(directory)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the tier opened on a disk that could not take a write"
    assert not (directory / f"{DB_NAME}.damaged").exists()
    assert value_files(directory) == files
    check_tier(directory, set())  # room again: everything is there


FULL_DISK_WRITES = """
import logging, resource, signal, sys
from pathlib import Path
from mlxd.engine.prefix_cache import SsdTier
from tests.cache.blocks import make_block
seen = []
handler = logging.Handler()
handler.emit = lambda record: seen.append((record.levelname, bool(record.exc_info)))
logging.getLogger("mlxd.engine.prefix_cache").addHandler(handler)
tier = SsdTier(Path(sys.argv[1]), 1 << 26)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # the disk fills up
for i in range(6):
    tier.put_async(f"{i:064x}", make_block(i, tokens=64))
tier.flush()
print(seen, tier.dropped)
tier.close()
"""


def test_a_disk_that_fills_up_pauses_writes_with_one_warning(tmp_path: Path) -> None:
    """Every block's failed write logged a traceback (hundreds a request) and left an empty
    value file: the first failure now warns once and pauses writing; nothing is left behind."""
    import ast
    import subprocess
    import sys

    directory = tmp_path / "ssd"
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK_WRITES, str(directory)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    logged, dropped = out.stdout.strip().rsplit(" ", 1)
    assert ast.literal_eval(logged) == [("WARNING", False)]
    assert int(dropped) == 6
    assert list(directory.rglob("*.val")) == []  # no value file a failed write began
