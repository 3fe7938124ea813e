"""Value files that no database row refers to (a process killed between writing a file and
committing its row) are reclaimed when the tier opens, and never a file another live process
may still be committing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlxd.engine import ssd_store
from mlxd.engine.prefix_cache import PrefixCache, SsdTier
from tests.cache.blocks import make_block
from tests.cache.test_prefix_cache import assert_same_block
from tests.fault.ssd import MiB, referenced, sql, value_files

ROOT = Path(__file__).resolve().parents[2]
KEYS = [f"{i:064x}" for i in range(8)]


def written(directory: Path, keys: list[str] = KEYS) -> None:
    tier = SsdTier(directory, 64 * MiB)
    for i, key in enumerate(keys):
        tier.put_async(key, make_block(i))
    tier.close()


def orphan(directory: Path, key: str) -> tuple[str, int]:
    """Forget `key`'s row, keeping its value file: what a kill between the two leaves."""
    ((name, size),) = sql(directory, "SELECT filename, size FROM Cache WHERE key = ?", key)
    sql(directory, "DELETE FROM Cache WHERE key = ?", key)
    return name, size


def stray(directory: Path, name: str, size: int, age: float = 0.0) -> None:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x01" * size)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))


def test_orphans_are_reclaimed_when_no_other_process_uses_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    lost = [orphan(directory, KEYS[i]) for i in (1, 4)]
    stray(directory, "0a/0b/" + "c" * 28 + ".val", 5000)  # young: the writer is gone anyway
    others = {"0a/0b/notes.txt", "0a/readme.val"}  # not shaped like value files: left alone
    for name in others:
        (directory / name).write_text("x")
    total = len(value_files(directory))
    cache = PrefixCache(64 * MiB, directory, 64 * MiB)
    try:
        snap = cache.snapshot()
        assert snap["ssd_orphans_reclaimed"] == 3
        assert snap["ssd_orphan_bytes_reclaimed"] == sum(s for _, s in lost) + 5000
        assert snap["ssd_orphan_bytes"] == 0
        assert cache.ssd is not None
        for i, key in enumerate(KEYS):
            got = cache.ssd.get(key)
            assert (got is None) == (i in (1, 4))
            if got is not None:
                assert_same_block(got, make_block(i))
    finally:
        cache.close()
    assert set(value_files(directory)) == referenced(directory)
    assert len(value_files(directory)) == total - 3
    assert all((directory / name).exists() for name in others)


_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from mlxd.engine.prefix_cache import SsdTier
    from tests.cache.blocks import make_block

    tier = SsdTier(Path(sys.argv[1]), 64 << 20)
    for i in range(3):
        tier.put_async(f"{500 + i:064x}", make_block(500 + i))
    tier.flush()
    print("open", flush=True)
    sys.stdin.read()  # until the test closes it
    tier.close()
    """
)


def test_young_orphans_are_kept_and_counted_while_another_process_uses_it(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ssd"
    written(directory)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory)], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        # Orphans appear while the other process has the directory open.
        old = [orphan(directory, KEYS[i]) for i in (0, 2)]
        for name, _ in old:
            when = time.time() - 2 * ssd_store.ORPHAN_GRACE_S
            os.utime(directory / name, (when, when))
        young = [orphan(directory, KEYS[6])]
        stray(directory, "0a/0b/" + "d" * 28 + ".val", 7000)
        young.append(("0a/0b/" + "d" * 28 + ".val", 7000))
        limit = 64 * MiB
        tier = SsdTier(directory, limit)
        try:
            r = tier.reclaimed
            assert (r.orphans, r.orphan_bytes) == (2, sum(s for _, s in old))
            left = sum(s for _, s in young)
            assert r.orphan_bytes_left == left
            assert tier.cache.size_limit == limit - left  # counted against the limit
            assert tier.nbytes >= left
            for i in range(3):  # the other process's entries are untouched
                assert_same_block(tier.get(f"{500 + i:064x}"), make_block(500 + i))
        finally:
            tier.close()
        for name, _ in young:
            assert (directory / name).exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(60) == 0
    # Once the other process is gone, the next open reclaims the rest.
    tier = SsdTier(directory, 64 * MiB)
    try:
        assert tier.reclaimed.orphans == 2 and tier.reclaimed.orphan_bytes_left == 0
    finally:
        tier.close()
    assert set(value_files(directory)) == referenced(directory)
