"""/api/pull, /api/delete and /api/copy through a real server, with the `ollama` client and raw
HTTP, pulling from the local hub."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from mlxd.registry.schema import load_registry_file
from mlxd.registry.store import resolve_local
from tests.conftest import RunningServer, ServerThread, wait_for
from tests.daemon.test_cli import mlxd as mlxd_cli
from tests.pull.conftest import DRAFT_REPO, GREEDY, TARGET_REPO, HubEnv

STATUSES = ["pulling manifest", "verifying sha256 digest", "writing manifest", "success"]
HUB_NAME = "hf.co/org/tiny:latest"


def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def tags(server: RunningServer) -> list[str]:
    r = httpx.get(f"{server.base_url}/api/tags", timeout=60)
    assert r.status_code == 200
    return [m["name"] for m in r.json()["models"]]


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def raw_pull(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/pull", json=body, timeout=120)


def test_pull_with_the_ollama_client_then_list_and_generate(
    mlxd: RunningServer, hub_env: HubEnv
) -> None:
    c = client(mlxd)
    assert HUB_NAME not in tags(mlxd)
    parts = list(c.pull("hf.co/org/tiny", stream=True))
    assert [p.status for p in parts if not p.digest] == STATUSES
    files = {p.digest for p in parts if p.digest}
    assert len(files) == 6
    for digest in files:
        lines = [p for p in parts if p.digest == digest]
        assert lines[0].status == f"pulling {digest[7:19]}"
        assert lines[-1].completed == lines[-1].total and lines[-1].total
    assert HUB_NAME in tags(mlxd)
    assert HUB_NAME in [m.model for m in c.list().models]
    out = c.generate(model=HUB_NAME, prompt="Why is the sky blue?", options=GREEDY)
    assert out.done and out.eval_count == GREEDY["num_predict"] and out.response


def test_a_new_revision_pulled_while_loaded_is_served_next(
    mlxd: RunningServer, hub_env: HubEnv
) -> None:
    """The hub's main moved and was pulled again while the model stayed loaded: the next
    request runs on the new weights (it kept the old ones until the model unloaded), and
    `/api/ps` names what is loaded."""
    c = client(mlxd)
    c.pull("hf.co/org/tiny")
    prompt = "Why is the sky blue?"
    before = c.generate(model=HUB_NAME, prompt=prompt, options=GREEDY).response
    hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.draft)  # a new commit on main
    c.pull("hf.co/org/tiny")
    after = c.generate(model=HUB_NAME, prompt=prompt, options=GREEDY).response
    assert after != before
    listed = {m.model: m.digest for m in c.list().models}
    assert {m.model: m.digest for m in c.ps().models} == {HUB_NAME: listed[HUB_NAME]}


def test_a_new_revision_is_served_next_while_the_old_one_finishes_a_stream(
    mlxd: RunningServer, hub_env: HubEnv
) -> None:
    """Busy when its new files arrive: the stream in flight finishes on the old weights and
    the next request loads the new ones (it was handed the busy old model)."""
    c = client(mlxd)
    c.pull("hf.co/org/tiny")
    prompt = "Why is the sky blue?"
    before = c.generate(model=HUB_NAME, prompt=prompt, options=GREEDY).response
    streamed: list[str] = []
    first = threading.Event()

    def long_stream() -> None:
        options = {"temperature": 0, "num_predict": 400}
        for part in c.generate(model=HUB_NAME, prompt=prompt, options=options, stream=True):
            streamed.append(part.response)
            first.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first.wait(60)
    hub_env.hub.add_repo(TARGET_REPO, hub_env.pair.draft)
    c.pull("hf.co/org/tiny")
    after = c.generate(model=HUB_NAME, prompt=prompt, options=GREEDY).response
    thread.join(120)
    assert after != before
    assert "".join(streamed).startswith(before)  # the old weights' answer, whole


def test_raw_stream_shape_and_stream_false(mlxd: RunningServer, hub_env: HubEnv) -> None:
    r = raw_pull(mlxd, {"model": "org/tiny"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r)
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1] == {"status": "success"}
    for line in lines:
        assert set(line) <= {"status", "digest", "total", "completed"}
        assert line.get("completed", 1) != 0  # omitted while 0
        if "digest" in line:
            assert line["status"] == f"pulling {line['digest'][7:19]}"
            assert line["total"] > 0

    r = raw_pull(mlxd, {"name": "org/tiny", "stream": False, "insecure": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"status": "success"}


def test_pull_errors(mlxd: RunningServer, hub_env: HubEnv) -> None:
    r = raw_pull(mlxd, {"model": "org/nope"})
    assert r.status_code == 200
    assert ndjson(r) == [
        {"status": "pulling manifest"},
        {"error": "pull model manifest: file does not exist"},
    ]
    with pytest.raises(ollama.ResponseError, match="file does not exist"):
        list(client(mlxd).pull("org/nope", stream=True))

    r = raw_pull(mlxd, {"model": "org/nope", "stream": False})
    assert (r.status_code, r.json()) == (404, {"error": "pull model manifest: file does not exist"})
    r = raw_pull(mlxd, {"model": "a/b/c/d"})
    assert (r.status_code, r.json()) == (400, {"error": "invalid model name"})
    r = raw_pull(mlxd, {})
    assert (r.status_code, r.json()) == (400, {"error": "model is required"})


def test_a_corrupted_pull_is_never_listed(mlxd: RunningServer, hub_env: HubEnv) -> None:
    hub_env.hub.corrupt(TARGET_REPO, "model.safetensors")
    lines = ndjson(raw_pull(mlxd, {"model": "org/tiny"}))
    assert lines[-2] == {"status": "verifying sha256 digest"}
    assert lines[-1]["error"].startswith("digest mismatch for model.safetensors")
    assert HUB_NAME not in tags(mlxd)
    r = httpx.post(f"{mlxd.base_url}/api/show", json={"model": HUB_NAME})
    assert r.status_code == 404


def test_a_registered_model_is_pulled_on_demand(mlxd: RunningServer, hub_env: HubEnv) -> None:
    assert "hubpair:latest" not in tags(mlxd)
    lines = ndjson(raw_pull(mlxd, {"model": "hubpair"}))
    assert lines[-1] == {"status": "success"}
    assert len({line["digest"] for line in lines if "digest" in line}) >= 11  # target + draft
    assert {"hubpair:latest", "hubtiny:latest"} <= set(tags(mlxd))
    assert not hub_env.user_file.exists()  # nothing to register


def test_delete(mlxd: RunningServer, hub_env: HubEnv) -> None:
    hub_env.hub.add_repo("org/solo", hub_env.pair.target)
    c = client(mlxd)
    c.pull("hf.co/org/solo")
    c.generate(model="hf.co/org/solo", prompt="hi", options=GREEDY)  # loaded, then deleted
    r = httpx.request("DELETE", f"{mlxd.base_url}/api/delete", json={"model": "hf.co/org/solo"})
    assert (r.status_code, r.content) == (200, b"")
    assert "hf.co/org/solo:latest" not in tags(mlxd)
    assert "hf.co/org/solo:latest" not in load_registry_file(hub_env.user_file)
    assert not hub_env.storage("org/solo").exists()
    with pytest.raises(ollama.ResponseError) as info:
        c.delete("hf.co/org/solo")
    assert info.value.status_code == 404
    assert info.value.error == "model 'hf.co/org/solo' not found"

    # org/tiny is also the target of `hubtiny` and `hubpair` (base registry): files stay
    c.pull("hf.co/org/tiny")
    assert c.delete(HUB_NAME).status == "success"
    assert HUB_NAME not in tags(mlxd)
    assert "hubtiny:latest" in tags(mlxd)
    assert resolve_local(TARGET_REPO) is not None
    r = httpx.request("DELETE", f"{mlxd.base_url}/api/delete", json={"model": "a/b/c/d"})
    assert (r.status_code, r.json()) == (400, {"error": 'name "a/b/c/d" is invalid'})


def test_copy_then_delete_keeps_shared_files(mlxd: RunningServer, hub_env: HubEnv) -> None:
    c = client(mlxd)
    c.pull("org/tiny")
    assert c.copy(HUB_NAME, "mine").status == "success"
    assert {HUB_NAME, "mine:latest"} <= set(tags(mlxd))
    entries = load_registry_file(hub_env.user_file)
    assert entries["mine:latest"].target == TARGET_REPO
    out = c.generate(model="mine", prompt="hello", options=GREEDY)
    assert out.eval_count == GREEDY["num_predict"]

    # a name matches whatever its case (Ollama's copy keeps the stored one): no second entry
    assert c.copy(HUB_NAME, "MINE").status == "success"
    assert "mine:latest" in tags(mlxd) and "MINE:latest" not in tags(mlxd)
    assert c.delete("mine").status == "success"
    assert "mine:latest" not in tags(mlxd) and HUB_NAME in tags(mlxd)
    assert resolve_local(TARGET_REPO) is not None  # still used by hf.co/org/tiny

    with pytest.raises(ollama.ResponseError) as info:
        c.copy("nope", "x")
    assert (info.value.status_code, info.value.error) == (404, 'model "nope" not found')
    r = httpx.post(f"{mlxd.base_url}/api/copy", json={"source": HUB_NAME, "destination": "a/b/c/d"})
    assert (r.status_code, r.json()) == (400, {"error": 'destination "a/b/c/d" is invalid'})
    r = httpx.post(f"{mlxd.base_url}/api/copy", json={"source": "", "destination": "x"})
    assert (r.status_code, r.json()) == (400, {"error": 'source "" is invalid'})


def test_deleting_a_packaged_entry_removes_its_files(mlxd: RunningServer, hub_env: HubEnv) -> None:
    """Entries from another registry file stay configured; their unshared downloads go."""
    c = client(mlxd)
    c.pull("hubpair")
    assert {"hubtiny:latest", "hubpair:latest"} <= set(tags(mlxd))
    assert c.delete("hubpair").status == "success"
    names = tags(mlxd)
    assert "hubpair:latest" not in names  # its draft is gone...
    assert "hubtiny:latest" in names  # ...its target, shared with hubtiny, is not
    assert resolve_local(DRAFT_REPO) is None and resolve_local(TARGET_REPO) is not None
    with pytest.raises(ollama.ResponseError) as info:
        c.delete("hubpair")  # configured, but nothing of its own is installed any more
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        c.delete("hubtiny")  # its only repo is hubpair's target too
    assert info.value.status_code == 400
    assert "also used by 'hubpair:latest'" in info.value.error
    c.pull("hubpair")
    assert "hubpair:latest" in tags(mlxd)


def test_a_fixed_registry_refuses_hub_names_and_copies(
    mlxd_fixed: RunningServer, hub_env: HubEnv
) -> None:
    lines = ndjson(raw_pull(mlxd_fixed, {"model": "org/tiny"}))
    assert "could not be served" in lines[-1]["error"]
    r = httpx.post(
        f"{mlxd_fixed.base_url}/api/copy", json={"source": "hubtiny", "destination": "x"}
    )
    assert r.status_code == 400 and "--registry" in r.json()["error"]
    assert ndjson(raw_pull(mlxd_fixed, {"model": "hubtiny"}))[-1] == {"status": "success"}


def test_the_name_a_repo_was_pulled_by_keeps_working_offline(
    mlxd: RunningServer, hub_env: HubEnv
) -> None:
    """`org/repo` is registered as `hf.co/org/repo:tag`; every route takes the short name
    too, so `mlxd run org/tiny` (which shows before pulling) serves from disk, hub or not."""
    c = client(mlxd)
    c.pull("org/tiny")
    hub_env.hub.stop()
    assert c.show("org/tiny").details is not None
    out = c.generate(model="org/tiny", prompt="Why is the sky blue?", options=GREEDY)
    assert out.done and out.eval_count == GREEDY["num_predict"]
    run = mlxd_cli(["run", "org/tiny", "hi", "--keepalive", "5m"], mlxd.port)
    assert run.returncode == 0, run.stderr
    stop = mlxd_cli(["stop", "org/tiny"], mlxd.port)  # loaded as its hub name: still stopped
    assert stop.returncode == 0 and b"not loaded" not in stop.stderr
    assert not c.ps().models
    c.copy("org/tiny", "mine")
    assert "mine:latest" in tags(mlxd)
    with pytest.raises(ollama.ResponseError) as info:  # a name never pulled stays unknown
        c.show("org/other")
    assert info.value.status_code == 404
    c.delete("org/tiny")
    assert HUB_NAME not in tags(mlxd)


def test_a_pull_ends_with_the_shutdown_line_when_the_daemon_is_told_to_stop(
    hub_env: HubEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As every stream in flight ends when the daemon stops: a pull waiting on a slow hub
    ends at once with the shutdown line (it waited out uvicorn's graceful timeout, then was
    cut with no line and a traceback in the log)."""
    monkeypatch.setenv("MLXD_REGISTRY", str(hub_env.user_file))
    hub_env.hub.stall_body = 30.0
    server = ServerThread(None)  # type: ignore[arg-type]
    with server as srv:
        lines: list[dict[str, Any]] = []

        def pull() -> None:
            body = {"model": "hf.co/org/tiny"}
            with httpx.stream("POST", f"{srv.base_url}/api/pull", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(json.loads(line))

        thread = threading.Thread(target=pull)
        thread.start()
        assert wait_for(lambda: any(line.get("digest") for line in lines), 30)
        t0 = time.monotonic()
        server.state.stop_serving()
        thread.join(20)
        assert time.monotonic() - t0 < 5
        assert lines[-1] == {"error": "mlxd is shutting down"}
