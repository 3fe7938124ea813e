"""The local hub answers huggingface_hub the way the real hub does (so pull tests mean something)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from tests.pull.conftest import TARGET_REPO, HubEnv
from tests.pull.hubserver import HubServer, git_oid


def test_model_info_with_file_metadata(hub_env: HubEnv) -> None:
    hub = hub_env.hub
    info = HfApi(endpoint=hub.url).model_info(TARGET_REPO, files_metadata=True)
    assert info.sha is not None and len(info.sha) == 40
    assert info.siblings is not None
    files = {s.rfilename: s for s in info.siblings}
    local = {p.name: p.read_bytes() for p in hub_env.pair.target.iterdir()}
    assert set(files) == set(local)
    for name, data in local.items():
        sibling = files[name]
        assert sibling.size == len(data)
        assert sibling.blob_id == git_oid(data)
        if name.endswith(".safetensors"):
            assert sibling.lfs is not None
            assert sibling.lfs.sha256 == hashlib.sha256(data).hexdigest()
            assert sibling.lfs.size == len(data)
        elif name == "config.json":
            assert sibling.lfs is None


def test_list_repo_tree_recursive_and_expanded(hub: HubServer) -> None:
    hub.add_repo("org/nested", {"config.json": b"{}", "sub/dir/model.safetensors": b"x" * 10})
    api = HfApi(endpoint=hub.url)
    flat = list(api.list_repo_tree("org/nested"))
    assert {type(x).__name__: x.path for x in flat} == {
        "RepoFile": "config.json",
        "RepoFolder": "sub",
    }
    deep = list(api.list_repo_tree("org/nested", recursive=True, expand=True))
    files = {x.path: x for x in deep if isinstance(x, RepoFile)}
    folders = {x.path for x in deep if isinstance(x, RepoFolder)}
    assert folders == {"sub", "sub/dir"}
    weights = files["sub/dir/model.safetensors"]
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(b"x" * 10).hexdigest()
    assert weights.last_commit is not None and weights.security is not None
    assert files["config.json"].blob_id == git_oid(b"{}")


def test_head_and_download_like_the_hub(hub_env: HubEnv, tmp_path: Path) -> None:
    hub = hub_env.hub
    data = (hub_env.pair.target / "model.safetensors").read_bytes()
    url = hf_hub_url(TARGET_REPO, "model.safetensors", endpoint=hub.url)
    meta = get_hf_file_metadata(url, endpoint=hub.url)
    assert meta.etag == hashlib.sha256(data).hexdigest()  # LFS: the sha256 (X-Linked-Etag)
    assert meta.size == len(data)
    assert meta.commit_hash == HfApi(endpoint=hub.url).model_info(TARGET_REPO).sha
    config = get_hf_file_metadata(hf_hub_url(TARGET_REPO, "config.json", endpoint=hub.url))
    assert config.etag == git_oid((hub_env.pair.target / "config.json").read_bytes())
    path = hf_hub_download(TARGET_REPO, "model.safetensors", endpoint=hub.url, cache_dir=tmp_path)
    assert Path(path).read_bytes() == data


def test_range_requests(hub_env: HubEnv) -> None:
    hub = hub_env.hub
    data = (hub_env.pair.target / "model.safetensors").read_bytes()
    url = hf_hub_url(TARGET_REPO, "model.safetensors", endpoint=hub.url)
    r = httpx.get(url, headers={"Range": "bytes=100-"})
    assert r.status_code == 206
    assert r.headers["content-range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
    assert r.content == data[100:]
    assert httpx.get(url, headers={"Range": f"bytes={len(data)}-"}).status_code == 416


def test_errors_map_to_huggingface_hub_exceptions(hub_env: HubEnv, tmp_path: Path) -> None:
    hub = hub_env.hub
    api = HfApi(endpoint=hub.url)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/nope")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(TARGET_REPO, revision="v9")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(TARGET_REPO, "nope.json", endpoint=hub.url, cache_dir=tmp_path)


def test_revisions(hub_env: HubEnv) -> None:
    hub = hub_env.hub
    commit = hub.add_repo(TARGET_REPO, hub_env.pair.draft, revision="v1")
    api = HfApi(endpoint=hub.url)
    assert api.model_info(TARGET_REPO, revision="v1").sha == commit
    assert api.model_info(TARGET_REPO).sha != commit
    assert api.model_info(TARGET_REPO, revision=commit).sha == commit
