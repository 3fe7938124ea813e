"""A hostile hub cannot make a pull write outside the hub cache and MLXD_HOME.

Every name the hub sends (listed file names, LFS sha256 and git oids from the listing, the
ETag of a download) ends up in a path; each test points one of them outside the cache, pulls,
and compares a snapshot of the directory above the cache and MLXD_HOME before and after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.registry.pull import PullError, pull
from mlxd.registry.store import resolve_local
from tests.conftest import RunningServer
from tests.pull.conftest import TARGET_REPO, HubEnv

Snapshot = dict[str, tuple[int, int]]


def outside(root: Path, allowed: tuple[Path, ...]) -> Snapshot:
    """(size, mtime) of every path under ``root`` but not under ``allowed`` (nor a directory
    on the way to one, which a pull may create), symlinks unfollowed."""
    on_the_way = {p for a in allowed for p in a.parents}
    found: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in allowed]
        for name in [*dirnames, *filenames]:
            if here / name in on_the_way:
                continue
            st = os.lstat(here / name)
            found[str((here / name).relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


def sentinel(env: HubEnv) -> tuple[Path, tuple[Path, ...]]:
    """The directory holding MLXD_HOME and HF_HOME, and the two places a pull may write."""
    return env.home.parent, (env.home, env.cache)


def assert_nothing_written_outside(env: HubEnv, before: Snapshot) -> None:
    root, allowed = sentinel(env)
    assert outside(root, allowed) == before
    assert resolve_local(TARGET_REPO) is None  # and nothing was published
    assert not env.user_file.exists()


def pull_fails(ref: str) -> PullError:
    with pytest.raises(PullError) as info:
        for _ in pull(ref):
            pass
    return info.value


def escapes(env: HubEnv) -> dict[str, str]:
    """Names that point outside the cache, relative to ``blobs/`` and absolute."""
    root = env.home.parent
    return {"relative": "../../../../escaped", "absolute": str(root / "abs-escape" / "blob")}


@pytest.mark.parametrize("kind", ["relative", "absolute"])
@pytest.mark.parametrize("path", ["model.safetensors", "config.json"])
def test_a_hostile_etag_once_the_file_is_down_is_never_a_path(
    mlxd: RunningServer, hub_env: HubEnv, kind: str, path: str
) -> None:
    """The hub answers the true ETag while the file downloads and a path afterwards (when
    the file used to be linked into the cache): the pull links what it verified and writes
    nothing outside."""
    hub_env.hub.serve_etag(TARGET_REPO, path, escapes(hub_env)[kind], after=2)
    root, allowed = sentinel(hub_env)
    before = outside(root, allowed)
    r = httpx.post(f"{mlxd.base_url}/api/pull", json={"model": "org/tiny"}, timeout=120)
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert lines[-1] == {"status": "success"}
    assert outside(root, allowed) == before
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None
    for f in hub_env.pair.target.iterdir():
        assert (snapshot / f.name).read_bytes() == f.read_bytes()
    assert (snapshot / path).resolve().parent == hub_env.storage(TARGET_REPO) / "blobs"


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_hostile_etag_from_the_start_fails_the_pull(hub_env: HubEnv, kind: str) -> None:
    hub_env.hub.serve_etag(TARGET_REPO, "model.safetensors", escapes(hub_env)[kind])
    root, allowed = sentinel(hub_env)
    before = outside(root, allowed)
    assert "the hub sent a bad ETag" in str(pull_fails("org/tiny"))
    assert_nothing_written_outside(hub_env, before)


def hostile_names(env: HubEnv) -> dict[str, str]:
    root = env.home.parent
    return {
        "dotdot": "../../../../../evil.json",
        "nested-dotdot": "sub/../../../../../../evil.json",
        "absolute": str(root / "abs-evil.json"),
        "nul": "evil\x00.json",
        "backslash": "..\\..\\evil.json",
        "empty-segment": "sub//evil.json",
        "dot": "./config.json",
    }


@pytest.mark.parametrize(
    "case", ["dotdot", "nested-dotdot", "absolute", "nul", "backslash", "empty-segment", "dot"]
)
def test_hostile_file_names_in_the_listing_fail_the_pull(hub_env: HubEnv, case: str) -> None:
    name = hostile_names(hub_env)[case]
    hub_env.hub.list_as(TARGET_REPO, "config.json", name=name)
    root, allowed = sentinel(hub_env)
    before = outside(root, allowed)
    error = pull_fails("org/tiny")
    assert "unsafe file name" in str(error)
    assert hub_env.hub.gets() == []  # refused before any download
    assert_nothing_written_outside(hub_env, before)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("model.safetensors", "sha256", "../../../../lfs-escape"),
        ("model.safetensors", "sha256", "{root}/lfs-escape"),
        ("model.safetensors", "sha256", "a" * 63 + "/"),
        ("config.json", "oid", "../../../../oid-escape"),
        ("config.json", "oid", "0" * 39 + "\x00"),
    ],
)
def test_hostile_hashes_in_the_listing_fail_the_pull(
    hub_env: HubEnv, path: str, field: str, value: str
) -> None:
    root, allowed = sentinel(hub_env)
    kwargs: dict[str, Any] = {field: value.replace("{root}", str(root))}
    hub_env.hub.list_as(TARGET_REPO, path, **kwargs)
    before = outside(root, allowed)
    error = pull_fails("org/tiny")
    assert "the hub sent" in str(error)
    assert hub_env.hub.gets() == []
    assert_nothing_written_outside(hub_env, before)
