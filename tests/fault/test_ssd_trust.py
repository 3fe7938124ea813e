"""The SSD tier does not trust its database: crafted rows never run code and never make it
read, delete or follow a path outside the cache directory."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT

from mlxd.engine.prefix_cache import SsdTier, encode
from tests.cache.blocks import make_block
from tests.fault.ssd import MiB, put_row, referenced, sql, tree, value_files

KEYS = [f"{i:064x}" for i in range(8)]


class _MakesDirectory:
    """Unpickling this creates a directory: proof that a pickle from the database ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def written_tier(directory: Path) -> None:
    """A tier with a few real entries (files and inline), closed."""
    tier = SsdTier(directory, 64 * MiB)
    for i, key in enumerate(KEYS[:4]):
        tier.put_async(key, make_block(i, tokens=64 if i % 2 == 0 else 4))
    tier.close()


def assert_intact(tier: SsdTier) -> None:
    """The genuine entries still read back, and new ones are stored."""
    for i, key in enumerate(KEYS[:4]):
        got = tier.get(key)
        assert got is not None and got.tokens == (64 if i % 2 == 0 else 4), key
    tier.put_async("e" * 64, make_block(50))
    tier.flush()
    assert tier.get("e" * 64) is not None


@pytest.mark.parametrize("when", ["before-open", "while-open"])
def test_a_pickled_row_never_runs(tmp_path: Path, when: str) -> None:
    directory = tmp_path / "ssd"
    written_tier(directory)
    marker = tmp_path / "pickle-ran"
    payload = pickle.dumps(_MakesDirectory(marker))
    in_file = "ab/cd/" + "0" * 28 + ".val"

    def craft() -> None:
        put_row(directory, "p" * 64, mode=MODE_PICKLE, value=payload)
        (directory / "ab" / "cd").mkdir(parents=True, exist_ok=True)
        (directory / in_file).write_bytes(payload)
        put_row(directory, "q" * 64, mode=MODE_PICKLE, filename=in_file, size=len(payload))
        put_row(directory, "r" * 64, mode=MODE_TEXT, filename=in_file, size=len(payload))

    if when == "before-open":
        craft()
    tier = SsdTier(directory, 64 * MiB)
    try:
        if when == "while-open":
            craft()
        for key in ("p" * 64, "q" * 64, "r" * 64):
            assert tier.get(key) is None
            assert not marker.exists(), "a pickle from the database ran"
            assert key not in tier.cache  # dropped
        assert_intact(tier)
    finally:
        tier.close()
    assert not marker.exists()


def victims(tmp_path: Path) -> dict[str, Path]:
    """Files (each alone in its directory) outside the cache that crafted rows name."""
    out: dict[str, Path] = {}
    for name in ("rel", "abs", "deep"):
        path = tmp_path / f"victim-{name}" / "file.val"
        path.parent.mkdir()
        path.write_bytes(encode(KEYS[7], make_block(7)))  # even a valid-looking entry
        out[name] = path
    return out


def crafted_paths(directory: Path, victim: dict[str, Path]) -> dict[str, str]:
    return {
        "a" * 64: "../victim-rel/file.val",
        "b" * 64: str(victim["abs"]),
        "c" * 64: "ab/../../victim-deep/file.val",
        KEYS[7]: "../victim-rel/file.val",  # under the very key the victim's bytes encode
    }


@pytest.mark.parametrize("when", ["before-open", "while-open"])
def test_rows_naming_paths_outside_delete_and_read_nothing(tmp_path: Path, when: str) -> None:
    directory = tmp_path / "ssd"
    written_tier(directory)
    victim = victims(tmp_path)
    rows = crafted_paths(directory, victim)

    def craft() -> None:
        for key, name in rows.items():
            # Oldest of all: the first the size limit culls.
            put_row(directory, key, mode=MODE_BINARY, filename=name, size=10, access_time=1.0)

    if when == "before-open":
        craft()
    before = tree(tmp_path)
    tier = SsdTier(directory, 2 * MiB)
    try:
        if when == "while-open":
            craft()
        for key in rows:
            assert tier.get(key) is None  # never read through the row
        if when == "while-open":
            craft()  # again: now the cull and an explicit delete meet them
            for key in rows:
                tier.cache.delete(key)
            craft()
        for i in range(120):  # ~4 MiB into a 2 MiB tier: the oldest rows are culled
            tier.put_async(f"{100 + i:064x}", make_block(100 + i))
        tier.flush()
        assert len(sql(directory, "SELECT 1 FROM Cache WHERE access_time = 1.0")) < len(rows)
    finally:
        tier.close()
    for path in victim.values():
        assert path.is_file() and path.read_bytes() == encode(KEYS[7], make_block(7))
    outside = {k: v for k, v in tree(tmp_path).items() if not k.startswith("ssd")}
    assert outside == {k: v for k, v in before.items() if not k.startswith("ssd")}


def test_garbage_settings_and_triggers_are_dropped(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written_tier(directory)
    sql(directory, "INSERT INTO Settings VALUES ('disk_evil', 1)")
    sql(directory, "INSERT INTO Settings VALUES ('sqlite_evil', 'x; DROP TABLE Cache')")
    sql(directory, "UPDATE Settings SET value = 'lots' WHERE key = 'size'")
    sql(directory, "UPDATE Settings SET value = 'nope' WHERE key = 'eviction_policy'")
    sql(directory, "CREATE TRIGGER evil AFTER INSERT ON Cache BEGIN DELETE FROM Cache; END")
    tier = SsdTier(directory, 64 * MiB)
    try:
        assert tier.reclaimed.rows_dropped == 2
        assert_intact(tier)
        assert tier.nbytes > 0
    finally:
        tier.close()


def test_rows_of_every_wrong_shape_are_misses(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written_tier(directory)
    tier = SsdTier(directory, 64 * MiB)
    try:
        good_file = sorted(referenced(directory))[0]
        garbage = {
            "g" * 64: {"mode": MODE_RAW, "value": 12345},
            "h" * 64: {"mode": MODE_RAW, "value": "text, not bytes"},
            "i" * 64: {"mode": MODE_BINARY, "filename": None},
            "j" * 64: {"mode": MODE_BINARY, "filename": 42},
            "k" * 64: {"mode": MODE_BINARY, "filename": "ab/cd/zz.val"},
            "l" * 64: {"mode": 99, "value": b"\x00"},
            "m" * 64: {"mode": MODE_RAW, "value": b"MLXDKV"},
        }
        for key, row in garbage.items():
            put_row(directory, key, **row)  # type: ignore[arg-type]
        for key in garbage:
            assert tier.get(key) is None, key
        assert_intact(tier)
    finally:
        tier.close()
    assert set(value_files(directory)) == referenced(directory)
    # A row naming another row's file (crafted while closed) goes; the first one stays.
    put_row(directory, "n" * 64, mode=MODE_BINARY, filename=good_file, size=10)
    tier = SsdTier(directory, 64 * MiB)
    try:
        assert tier.reclaimed.rows_dropped == 1
        assert tier.get("n" * 64) is None
        assert_intact(tier)
    finally:
        tier.close()


def test_a_symlinked_subdirectory_is_never_written_read_or_emptied_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "ssd"
    written_tier(directory)
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    # Every subdirectory the entries above left free is a symlink out of the cache.
    linked = []
    for i in range(256):
        sub = directory / f"{i:02x}"
        if not sub.exists():
            sub.symlink_to(outside_dir)
            linked.append(i)
    # the store names a value file at random: this one's first level is a symlinked one
    urandom = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: bytes([linked[0]]) + urandom(n - 1))
    tier = SsdTier(directory, 64 * MiB)
    try:
        tier.put_async("f" * 64, make_block(60))  # a file: it would land in a symlinked dir
        tier.flush()
        monkeypatch.undo()
        assert tier.get("f" * 64) is None
        for key in KEYS[:4]:  # the rows written before still read through real directories
            assert tier.get(key) is not None
    finally:
        tier.close()
    assert list(outside_dir.iterdir()) == []
