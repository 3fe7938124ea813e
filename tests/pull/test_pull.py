"""mlxd.registry.pull.pull against the local hub: progress shape, cache reuse, resume, verification
and the errors a user can meet (unknown repo, no network, offline, disk full)."""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import shutil
import threading
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import snapshot_download

import mlxd.registry.pull as pull_module
from mlxd.registry.pull import Progress, PullError, pull
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry, load_registry_file
from mlxd.registry.store import MODEL_FILE_PATTERNS, resolve_local
from tests.pull.conftest import DRAFT_REPO, TARGET_REPO, HubEnv, unused_endpoint

STATUSES = ("pulling manifest", "verifying sha256 digest", "writing manifest", "success")


def run(ref: str, **kwargs: Any) -> list[Progress]:
    return list(pull(ref, **kwargs))


def failing(ref: str, **kwargs: Any) -> tuple[list[Progress], PullError]:
    items: list[Progress] = []
    with pytest.raises(PullError) as info:
        for item in pull(ref, **kwargs):
            items.append(item)
    return items, info.value


def user_entries(env: HubEnv) -> dict[str, ModelEntry]:
    return load_registry_file(env.user_file) if env.user_file.exists() else {}


def model_files(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in directory.iterdir()
        if any(fnmatch.fnmatch(p.name, pat) for pat in MODEL_FILE_PATTERNS)
    }


def by_digest(items: list[Progress]) -> dict[str, list[Progress]]:
    out: dict[str, list[Progress]] = {}
    for item in items:
        if item.digest:
            out.setdefault(item.digest, []).append(item)
    return out


def test_progress_stream_shape(hub_env: HubEnv) -> None:
    items: list[Progress] = []
    for item in pull("hf.co/org/tiny"):
        items.append(item)
        if item.status != "success":
            # nothing is visible before the pull is complete and verified
            assert resolve_local(TARGET_REPO) is None
            assert "hf.co/org/tiny:latest" not in user_entries(hub_env)

    plain = [i.status for i in items if not i.digest]
    assert plain == list(STATUSES)
    first_file = next(n for n, i in enumerate(items) if i.digest)
    assert items[0].status == "pulling manifest" and first_file == 1
    assert all(i.digest for i in items[1 : len(items) - 3])

    files = model_files(hub_env.pair.target)
    sha = {hashlib.sha256(data).hexdigest(): name for name, data in files.items()}
    groups = by_digest(items)
    assert len(groups) == len(files)
    for digest, lines in groups.items():
        hexdigest = digest.removeprefix("sha256:")
        assert len(hexdigest) == 64
        assert {line.status for line in lines} == {f"pulling {hexdigest[:12]}"}
        total = lines[0].total
        assert total and all(line.total == total for line in lines)
        completed = [line.completed or 0 for line in lines]
        assert completed == sorted(completed) and completed[-1] == total
        assert lines[0].as_dict().get("completed") is None  # omitted while 0, as Ollama does
        if hexdigest in sha:  # LFS files carry their real sha256
            assert total == len(files[sha[hexdigest]])
    weights = hashlib.sha256(files["model.safetensors"]).hexdigest()
    assert f"sha256:{weights}" in groups

    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None and model_files(snapshot) == files
    entry = user_entries(hub_env)["hf.co/org/tiny:latest"]
    assert entry.target == TARGET_REPO


def test_a_second_pull_is_served_from_the_cache(hub_env: HubEnv) -> None:
    run("org/tiny")
    hub_env.hub.clear()
    items = run("org/tiny")
    assert hub_env.hub.gets() == []
    assert [r.method for r in hub_env.hub.requests] == ["GET"]  # the listing, nothing else
    for lines in by_digest(items).values():
        assert len(lines) == 1 and lines[0].completed == lines[0].total
    assert [i.status for i in items if not i.digest] == list(STATUSES)


def test_files_already_in_the_hf_cache_are_not_downloaded(hub_env: HubEnv) -> None:
    snapshot_download(TARGET_REPO, endpoint=hub_env.hub.url, cache_dir=hub_env.cache)
    hub_env.hub.clear()
    run("org/tiny")
    assert hub_env.hub.gets() == []
    assert "hf.co/org/tiny:latest" in user_entries(hub_env)


def flip_middle(path: Path) -> None:
    """Damage a file in place, its size unchanged (a bad sector, a stray write)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_pulling_again_repairs_a_file_damaged_on_disk(hub_env: HubEnv, name: str) -> None:
    run("org/tiny")
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None
    flip_middle(snapshot / name)
    hub_env.hub.clear()
    run("org/tiny")
    assert [g.path.rsplit("/", 1)[-1] for g in hub_env.hub.gets()] == [name]  # that file only
    assert model_files(snapshot) == model_files(hub_env.pair.target)
    hub_env.hub.clear()
    run("org/tiny")  # intact again, and its hash remembered: nothing more is fetched
    assert hub_env.hub.gets() == []


def test_a_cut_connection_resumes_with_a_range_request(hub_env: HubEnv) -> None:
    hub_env.hub.cut(TARGET_REPO, "model.safetensors", after=100_000)
    run("org/tiny")
    gets = hub_env.hub.gets("model.safetensors")
    assert len(gets) == 2
    assert gets[0].range is None
    assert gets[1].range is not None
    start = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 100_000
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None
    assert model_files(snapshot) == model_files(hub_env.pair.target)


def test_an_interrupted_pull_resumes_in_the_next_one(hub_env: HubEnv) -> None:
    hub_env.hub.cut(TARGET_REPO, "model.safetensors", after=100_000, then_status=503)
    items, error = failing("org/tiny")
    assert "model.safetensors" in str(error) and "503" in str(error)
    assert "verifying sha256 digest" not in [i.status for i in items]
    assert resolve_local(TARGET_REPO) is None
    assert user_entries(hub_env) == {}
    sha = hashlib.sha256((hub_env.pair.target / "model.safetensors").read_bytes()).hexdigest()
    partial = hub_env.storage(TARGET_REPO) / "blobs" / f"{sha}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept <= 100_000

    hub_env.hub.clear()
    run("org/tiny")
    (get,) = hub_env.hub.gets("model.safetensors")
    assert get.range == f"bytes={kept}-"
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None
    assert model_files(snapshot) == model_files(hub_env.pair.target)
    assert not list(hub_env.storage(TARGET_REPO).glob("blobs/*.incomplete"))


def test_a_corrupted_file_is_rejected_and_nothing_is_registered(hub_env: HubEnv) -> None:
    hub_env.hub.corrupt(TARGET_REPO, "model.safetensors")
    items, error = failing("hf.co/org/tiny")
    assert str(error).startswith("digest mismatch for model.safetensors")
    assert items[-1].status == "verifying sha256 digest"
    assert resolve_local(TARGET_REPO) is None
    assert user_entries(hub_env) == {}
    sha = hashlib.sha256((hub_env.pair.target / "model.safetensors").read_bytes()).hexdigest()
    blobs = hub_env.storage(TARGET_REPO) / "blobs"
    assert not (blobs / sha).exists() and not (blobs / f"{sha}.incomplete").exists()


def test_a_corrupted_small_file_is_rejected_too(hub_env: HubEnv) -> None:
    hub_env.hub.corrupt(TARGET_REPO, "config.json")  # not LFS: checked with its git hash
    _, error = failing("org/tiny")
    assert str(error).startswith("digest mismatch for config.json")
    assert resolve_local(TARGET_REPO) is None


def test_unknown_repo_and_revision(hub_env: HubEnv) -> None:
    for ref in ("org/nope", "hf.co/org/tiny:v9", "llama3.2"):
        items, error = failing(ref)
        assert [i.status for i in items] == ["pulling manifest"]
        assert str(error) == "pull model manifest: file does not exist", ref


def test_no_network(hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = unused_endpoint()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    _, error = failing("org/tiny")
    assert str(error).startswith(f"pull model manifest: cannot reach {endpoint}: ")


def test_offline_mode(hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, error = failing("org/tiny")
    assert "offline mode" in str(error) and "not in the local cache" in str(error)
    assert hub_env.hub.requests == []

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    run("org/tiny")
    (hub_env.user_file).unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_env.hub.clear()
    items = run("org/tiny")  # already cached: fine offline, and registered again
    assert hub_env.hub.requests == []
    assert items[-1].status == "success"
    assert "hf.co/org/tiny:latest" in user_entries(hub_env)


def test_disk_full(hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    Usage = namedtuple("Usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    _, error = failing("org/tiny")
    assert str(error).startswith("no space left on device: the download needs")
    monkeypatch.setattr(shutil, "disk_usage", real)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pull_module, "http_get", full)
    _, error = failing("org/tiny")
    assert str(error) == "no space left on device"
    assert resolve_local(TARGET_REPO) is None


def test_a_revision_is_registered_at_its_snapshot(hub_env: HubEnv) -> None:
    commit = hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.draft, revision="v1")
    run("hf.co/org/tiny:v1")
    entry = user_entries(hub_env)["hf.co/org/tiny:v1"]
    snapshot = hub_env.storage(TARGET_REPO) / "snapshots" / commit
    assert entry.target == str(snapshot)
    assert model_files(snapshot) == model_files(hub_env.pair.draft)
    assert resolve_local(TARGET_REPO) is None  # main was not pulled
    assert (hub_env.storage(TARGET_REPO) / "refs" / "v1").read_text() == commit


def test_a_registry_name_pulls_target_and_draft(hub_env: HubEnv, tmp_path: Path) -> None:
    path = tmp_path / "reg.yaml"
    path.write_text(f"models:\n  duo:\n    target: {TARGET_REPO}\n    draft: {DRAFT_REPO}\n")
    items = run("duo", registry=Registry.load([path]))
    target = model_files(hub_env.pair.target)
    draft = model_files(hub_env.pair.draft)
    weights = {
        f"sha256:{hashlib.sha256(files['model.safetensors']).hexdigest()}"
        for files in (target, draft)
    }
    groups = by_digest(items)
    assert weights <= set(groups)
    for lines in groups.values():  # the tokenizer both share: one series, as Ollama's bar
        completed = [line.completed or 0 for line in lines]
        assert completed == sorted(completed) and completed.count(lines[0].total) == 1
    assert resolve_local(TARGET_REPO) is not None and resolve_local(DRAFT_REPO) is not None
    assert user_entries(hub_env) == {}  # already registered: nothing to add


def test_pulling_a_tag_again_follows_it_where_it_moved(hub_env: HubEnv) -> None:
    """As `ollama pull model:tag`: the tag is looked up again (it pinned the entry to the
    commit it named then), and the entry keeps what the user added to it."""
    first = hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.target, revision="stable")
    run("hf.co/org/tiny:stable")
    storage = hub_env.storage(TARGET_REPO)
    assert user_entries(hub_env)["hf.co/org/tiny:stable"].target == str(
        storage / "snapshots" / first
    )
    text = hub_env.user_file.read_text(encoding="utf-8")
    hub_env.user_file.write_text(text + "    system: Be brief.\n", encoding="utf-8")
    moved = hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.draft, revision="stable")
    registry = Registry.load([hub_env.user_file])
    run("hf.co/org/tiny:stable", registry=registry)
    entry = user_entries(hub_env)["hf.co/org/tiny:stable"]
    assert entry.target == str(storage / "snapshots" / moved)
    assert model_files(Path(entry.target)) == model_files(hub_env.pair.draft)
    assert entry.system == "Be brief."
    hub_env.hub.clear()
    run(f"hf.co/org/tiny:{moved}", registry=Registry.load([hub_env.user_file]))
    assert hub_env.hub.gets() == []  # a commit never moves: nothing fetched


def test_a_tag_pinned_under_its_own_name_is_updated_there(hub_env: HubEnv) -> None:
    """An entry the user named `org/tiny:stable`, pinned to the commit its tag named: pulling
    that name again moves that entry, not a `hf.co/...` copy of it beside."""
    first = hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.target, revision="stable")
    run("hf.co/org/tiny:stable")
    snapshot = hub_env.storage(TARGET_REPO) / "snapshots" / first
    hub_env.user_file.write_text(
        f"models:\n  org/tiny:stable:\n    target: {snapshot}\n", encoding="utf-8"
    )
    moved = hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.draft, revision="stable")
    run("org/tiny:stable", registry=Registry.load([hub_env.user_file]))
    entries = user_entries(hub_env)
    assert list(entries) == ["org/tiny:stable"]
    assert entries["org/tiny:stable"].target == str(snapshot.parent / moved)


def test_a_hub_that_never_answers_the_listing_fails_the_pull(
    hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pull_module, "MANIFEST_TIMEOUT_S", 0.5)
    hub_env.hub.stall_api = 3.0
    items, error = failing("org/tiny")
    assert [i.status for i in items] == ["pulling manifest"]
    assert "timed out" in str(error) or "cannot reach" in str(error), str(error)


def test_hub_names_need_the_user_registry(hub_env: HubEnv, tmp_path: Path) -> None:
    path = tmp_path / "reg.yaml"
    path.write_text("models:\n")
    _, error = failing("org/tiny", registry=Registry.load([path]))
    assert "could not be served" in str(error) and "--registry" in str(error)


def test_token_goes_to_the_hub_but_not_to_a_cdn(
    hub_env: HubEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub_env.hub.lfs_redirect = True
    run("org/tiny")
    listing = hub_env.hub.requests[0]
    assert listing.headers.get("authorization") == "Bearer hf_secret"
    cdn = [r for r in hub_env.hub.gets() if r.path.startswith("/cdn/")]
    assert any(
        r.path.endswith(hub_env.hub.file(TARGET_REPO, "model.safetensors").sha256) for r in cdn
    )
    assert all("authorization" not in r.headers for r in cdn)
    assert all(r.headers.get("authorization") for r in hub_env.hub.gets() if "/resolve/" in r.path)
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None and model_files(snapshot) == model_files(hub_env.pair.target)


def test_closing_the_stream_cancels_cleanly(hub_env: HubEnv) -> None:
    stream = pull("org/tiny")
    for item in stream:
        if item.digest:
            break
    stream.close()
    assert resolve_local(TARGET_REPO) is None
    assert user_entries(hub_env) == {}
    assert run("org/tiny")[-1].status == "success"
    assert resolve_local(TARGET_REPO) is not None


def test_two_simultaneous_pulls_download_each_file_once(hub_env: HubEnv) -> None:
    results: list[list[Progress]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(run("org/tiny"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 2
    assert all(items[-1].status == "success" for items in results)
    files = model_files(hub_env.pair.target)
    assert sorted(r.path.rsplit("/", 1)[-1] for r in hub_env.hub.gets()) == sorted(files)
    snapshot = resolve_local(TARGET_REPO)
    assert snapshot is not None and model_files(snapshot) == files
    assert list(user_entries(hub_env)) == ["hf.co/org/tiny:latest"]
