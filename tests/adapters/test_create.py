"""Adapter entries and Ollama's create flow through a real server: one base load serves every
adapter; `create_blob` + `create(from_=, adapters=)` with the `ollama` client, the Modelfile
(raw and through `mlxd create`), `mlxd show --modelfile`, and bad input answered cleanly."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import ollama
import pytest

from mlxd.engine.counts import LOAD
from mlxd.registry.schema import load_registry_file
from mlxd.registry.store import ADAPTER_FILES
from tests.adapters.conftest import Adapters
from tests.conftest import RunningServer, ServerThread, wait_for
from tests.fixtures.tiny_models import TinyPair

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "num_predict": 12}
PROMPT = "SELECT name FROM"


@pytest.fixture
def served(
    tiny_pair: TinyPair, adapters: Adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RunningServer, ServerThread]]:
    """A server reading a base registry (a model and two adapter entries on its target) plus
    the user registry, in a fresh MLXD_HOME."""
    home = tmp_path / "home"
    monkeypatch.setenv("MLXD_HOME", str(home))
    base = tmp_path / "base.yaml"
    base.write_text(
        "models:\n"
        f"  coder:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"  coder-sql:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"    adapters: [{adapters.sql}]\n"
        f"  coder-tests:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"    adapters:\n      - path: {adapters.tests}\n"
        "  shipped:\n    target: embedded:tiny/target\n",  # the package's own model
        encoding="utf-8",
    )
    monkeypatch.setenv("MLXD_REGISTRY", f"{base}{os.pathsep}{home / 'models.yaml'}")
    thread = ServerThread(None)  # type: ignore[arg-type]
    with thread as info:
        info.registry = base
        yield info, thread


def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def upload(c: ollama.Client, adapter: Path) -> dict[str, str]:
    """An adapter folder's files as blobs: {filename: digest}, as `create(adapters=)` takes."""
    return {name: c.create_blob(adapter / name) for name in ADAPTER_FILES}


def answer(server: RunningServer, model: str) -> str:
    return client(server).generate(model=model, prompt=PROMPT, options=GREEDY, raw=True).response


def scored(server: RunningServer, model: str) -> tuple[str, list[float]]:
    """A greedy answer and its tokens' log-probabilities."""
    body = {"model": model, "prompt": PROMPT, "options": GREEDY, "raw": True, "stream": False,
            "logprobs": True}  # fmt: skip
    reply = httpx.post(f"{server.base_url}/api/generate", json=body, timeout=60).json()
    return reply["response"], [entry["logprob"] for entry in reply["logprobs"]]


def loads(thread: ServerThread) -> int:
    return sum(thread.state.manager.counts.snapshot()[LOAD].values())


def tags(server: RunningServer) -> list[str]:
    return [m["name"] for m in httpx.get(f"{server.base_url}/api/tags").json()["models"]]


def add_entry(served: tuple[RunningServer, ServerThread], name: str, lines: str) -> None:
    """Append an entry on `coder`'s target and draft, with `lines` (its other keys), to the
    registry the server reads, and wait until it is listed."""
    server, thread = served
    coder = thread.state.registry().get("coder")
    text = server.registry.read_text(encoding="utf-8")
    entry = f"  {name}:\n    target: {coder.target}\n    draft: {coder.draft}\n{lines}"
    server.registry.write_text(text + entry, encoding="utf-8")
    assert wait_for(lambda: f"{name}:latest" in tags(server))


def test_entries_on_one_base_load_it_once_and_each_answers_as_its_adapter(
    served: tuple[RunningServer, ServerThread],
) -> None:
    server, thread = served
    base = answer(server, "coder")
    sql, tests = answer(server, "coder-sql"), answer(server, "coder-tests")
    assert len({base, sql, tests}) == 3
    assert answer(server, "coder") == base  # the base entry is unchanged by mounted adapters
    assert loads(thread) == 1
    assert len(thread.state.manager.loaded()) == 1
    ps = httpx.get(f"{server.base_url}/api/ps").json()["models"]
    assert len(ps) == 1
    # listed as Ollama lists a model with an adapter layer: its own ID, the layer's bytes
    listed = {m["name"]: m for m in httpx.get(f"{server.base_url}/api/tags").json()["models"]}
    ids = {listed[f"{n}:latest"]["digest"] for n in ("coder", "coder-sql", "coder-tests")}
    assert len(ids) == 3
    assert listed["coder-sql:latest"]["size"] > listed["coder:latest"]["size"]


def test_an_adapter_added_by_a_registry_edit_is_served_without_reloading_the_base(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    server, thread = served
    base = answer(server, "coder")
    add_entry(served, "coder-dora", f"    adapters: [{{path: {adapters.dora}, scale: 5.0}}]\n")
    dora = answer(server, "coder-dora")
    assert dora != base and answer(server, "coder") == base
    assert loads(thread) == 1


def test_an_adapter_entry_with_its_own_go_template_decodes_on_the_loaded_base(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """An Ollama (Go) template is rendered per request, so an adapter entry with one shares the
    base its siblings decode on (it loaded a second base); its template is applied."""
    server, thread = served
    sql = answer(server, "coder-sql")
    add_entry(
        served,
        "coder-sql-go",
        f"    adapters: [{adapters.sql}]\n    template: '{{{{ .Prompt }}}}'\n",
    )
    templated = client(server).generate(model="coder-sql-go", prompt=PROMPT, options=GREEDY)
    assert templated.response == sql  # the template renders the prompt as it is
    assert loads(thread) == 1
    assert len(httpx.get(f"{server.base_url}/api/ps").json()["models"]) == 1


def test_the_shown_modelfile_creates_the_model_again_with_its_adapters_scales(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """`/api/show`'s Modelfile names each adapter's scale and the draft's adapters, so a model
    created from it is the same model (it lost them: the adapter came back at its trained
    scale)."""
    server, thread = served
    lines = f"    adapters: [{{path: {adapters.sql}, scale: 2.5}}]\n"
    add_entry(served, "coder-scaled", lines + f"    draft_adapters: [{adapters.draft}]\n")
    shown = httpx.post(f"{server.base_url}/api/show", json={"model": "coder-scaled"}).json()
    body = {"model": "again", "modelfile": shown["modelfile"]}
    assert httpx.post(f"{server.base_url}/api/create", json=body, timeout=60).status_code == 200
    assert wait_for(lambda: "again:latest" in tags(server))
    again, scaled = (
        thread.state.registry().get("again"),
        thread.state.registry().get("coder-scaled"),
    )
    assert again.adapters == scaled.adapters and again.adapters[0].scale == 2.5
    assert again.draft_adapters == scaled.draft_adapters
    # the scale shows in the target's probabilities, whether or not it changes a greedy token
    text, values = scored(server, "again")
    scaled_text, scaled_values = scored(server, "coder-scaled")
    assert text == scaled_text and values == pytest.approx(scaled_values, abs=1e-4)
    at_one = scored(server, "coder-sql")[1]
    assert max(abs(a - b) for a, b in zip(values, at_one, strict=False)) > 1e-3


def test_a_hub_adapter_is_shown_by_its_directory_and_the_modelfile_creates_the_model_again(
    served: tuple[RunningServer, ServerThread],
    adapters: Adapters,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter named by its hub repository is written in the shown Modelfile as the
    directory it was pulled to, as `FROM` is (it was written as the repo id, which a
    Modelfile reads as a path beside it, so the create was refused)."""
    server, thread = served
    cache = tmp_path / "hub"
    commit = "0" * 40
    repo = cache / "models--acme--sql-lora"
    shutil.copytree(adapters.sql, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    add_entry(served, "coder-hub", "    adapters: [{path: acme/sql-lora, scale: 3.0}]\n")
    shown = httpx.post(f"{server.base_url}/api/show", json={"model": "coder-hub"}).json()
    assert f"ADAPTER {repo / 'snapshots' / commit} scale=3" in shown["modelfile"]
    body = {"model": "again-hub", "modelfile": shown["modelfile"]}
    created = httpx.post(f"{server.base_url}/api/create", json=body, timeout=60)
    assert created.status_code == 200, created.text
    assert wait_for(lambda: "again-hub:latest" in tags(server))
    assert answer(server, "again-hub") == answer(server, "coder-hub") != answer(server, "coder")
    assert loads(thread) == 1


def test_deleting_the_last_model_on_an_uploaded_adapter_removes_its_files(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """As Ollama prunes a deleted model's layers that no other model uses: the adapter
    directory a create assembled, and the blobs linked into it, go with the last model on
    them; a model still on them keeps them."""
    server, _ = served
    c = client(server)
    home = Path(os.environ["MLXD_HOME"])
    files = upload(c, adapters.sql)
    blobs = {home / "blobs" / d.replace(":", "-") for d in files.values()}
    for name in ("one", "two"):
        assert c.create(model=name, from_="coder", adapters=files).status == "success"
    [folder] = list((home / "adapters").iterdir())
    c.delete("one")
    assert folder.is_dir() and all(b.is_file() for b in blobs)  # "two" is on them
    assert answer(server, "two") == answer(server, "coder-sql")
    c.delete("two")
    assert not folder.exists() and not any(b.exists() for b in blobs)
    assert answer(server, "coder-sql")  # adapters the registry names are never touched
    assert (adapters.sql / "adapters.safetensors").is_file()


def test_a_model_created_from_one_on_an_adapter_adds_its_own_to_it(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """As Ollama adds a Modelfile's adapter layers to its FROM model's: created from
    `coder-sql` with the tests adapter, the model is on both, as an entry naming both is (it
    was on the new one alone); an adapter it already has is not added twice."""
    server, thread = served
    modelfile = f"FROM coder-sql\nADAPTER {adapters.tests}\nADAPTER {adapters.sql}\n"
    r = httpx.post(f"{server.base_url}/api/create", json={"model": "both", "modelfile": modelfile})
    assert r.status_code == 200, r.text
    both = thread.state.registry().get("both")
    assert [Path(a.ref) for a in both.adapters] == [adapters.sql, adapters.tests]
    add_entry(served, "named-both", f"    adapters: [{adapters.sql}, {adapters.tests}]\n")
    assert answer(server, "both") == answer(server, "named-both")
    assert answer(server, "both") != answer(server, "coder-tests")


def test_a_create_refused_after_its_adapter_was_assembled_leaves_no_folder(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """A refusal found after the uploaded files were assembled (an unknown parameter, a
    draft that is not there) removes the folder it assembled: nothing half-made stays."""
    server, _ = served
    c = client(server)
    home = Path(os.environ["MLXD_HOME"])
    files = upload(c, adapters.tests)
    for extra in ({"parameters": {"bogus": 1}}, {"modelfile": "FROM coder\nDRAFT /no/draft\n"}):
        body = {"model": "half", "from": "coder", "adapters": files, **extra}
        r = httpx.post(f"{server.base_url}/api/create", json=body, timeout=60)
        assert r.status_code in (400, 404), r.text
        assert not list((home / "adapters").glob("[0-9a-f]*"))
        assert "half:latest" not in tags(server)


def test_removing_or_moving_entries_keeps_the_base_the_others_use(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """A comment that moves every entry's line changes nothing served; removing one adapter
    entry leaves the base its siblings decode on loaded."""
    server, thread = served
    base, sql = answer(server, "coder"), answer(server, "coder-sql")
    tests = answer(server, "coder-tests")
    text = server.registry.read_text(encoding="utf-8")
    server.registry.write_text("# moved every line down\n" + text, encoding="utf-8")
    kept = text.split("  coder-tests:")[0] + "  shipped:" + text.split("  shipped:")[1]
    server.registry.write_text(kept, encoding="utf-8")
    assert wait_for(lambda: "coder-tests:latest" not in tags(server))
    assert httpx.get(f"{server.base_url}/api/ps").json()["models"]  # still loaded
    assert answer(server, "coder") == base and answer(server, "coder-sql") == sql != tests
    assert loads(thread) == 1


def test_the_adapter_budget_drops_the_least_recently_used(
    tiny_pair: TinyPair, adapters: Adapters, tmp_path: Path
) -> None:
    """`MLXD_ADAPTER_BYTES` below one adapter's size: an adapter is dropped once no request
    uses it, the next request mounts its own, and each still answers as its adapter."""
    registry = tmp_path / "models.yaml"
    registry.write_text(
        f"models:\n  coder:\n    target: {tiny_pair.target}\n"
        f"  coder-sql:\n    target: {tiny_pair.target}\n    adapters: [{adapters.sql}]\n"
        f"  coder-tests:\n    target: {tiny_pair.target}\n    adapters: [{adapters.tests}]\n",
        encoding="utf-8",
    )

    def mounted(base: str) -> float:
        for line in httpx.get(f"{base}/metrics").text.splitlines():
            if line.startswith('mlxd_adapters_mounted{model="coder'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    with ServerThread(registry) as roomy:
        answers = {m: answer(roomy, m) for m in ("coder-sql", "coder-tests", "coder")}
        assert mounted(roomy.base_url) == 2  # both stay resident under the 2 GiB default
    with ServerThread(registry, adapter_bytes=1) as tight:
        for model in ("coder-sql", "coder-tests", "coder-sql"):
            assert answer(tight, model) == answers[model]
            assert mounted(tight.base_url) == 0
        assert answer(tight, "coder") == answers["coder"]


def test_ps_names_an_entry_the_base_still_serves(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """One row for the shared base (its memory once), named by the entry it was loaded for
    while that one is served, else by the one used last: never by a removed entry."""
    server, _ = served
    answer(server, "coder-sql")
    answer(server, "coder")

    def ps() -> list[str]:
        return [m["name"] for m in httpx.get(f"{server.base_url}/api/ps").json()["models"]]

    assert ps() == ["coder-sql:latest"]
    row = httpx.get(f"{server.base_url}/api/ps").json()["models"][0]
    assert row["serves"] == ["coder-sql:latest", "coder:latest"]
    text = server.registry.read_text(encoding="utf-8")
    head, rest = text.split("  coder-sql:")
    server.registry.write_text(head + "  coder-tests:" + rest.split("  coder-tests:")[1])
    assert wait_for(lambda: "coder-sql:latest" not in tags(server))
    assert ps() == ["coder:latest"]
    stats = httpx.get(f"{server.base_url}/api/mlxd/stats").json()
    assert [m["name"] for m in stats["models"]] == ["coder:latest"]  # as /api/ps names it
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'mlxd_rows_running{model="coder:latest"}' in metrics
    gauges = ("mlxd_rows_running", "mlxd_adapters_mounted", "mlxd_adapter_bytes")
    assert not [
        line for line in metrics.splitlines() if line.startswith(gauges) and "coder-sql" in line
    ]
    assert "not loaded" in cli(["stop", "coder-tests"], server).stderr  # never used on it
    answer(server, "coder-tests")
    stop = cli(["stop", "coder-tests"], server)  # served by the base ps lists as coder
    assert stop.returncode == 0 and "not loaded" not in stop.stderr, stop.stderr
    assert wait_for(lambda: not ps())


def test_ollama_client_create_blob_then_create_then_generate(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    server, thread = served
    c = client(server)
    want = answer(server, "coder-sql")
    files = upload(c, adapters.sql)
    parts = list(c.create(model="mine-sql", from_="coder", adapters=files, stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "converting adapter"
    assert statuses[1].startswith("creating new layer sha256:")
    assert statuses[-2:] == ["writing manifest", "success"]
    assert "mine-sql:latest" in tags(server)
    assert answer(server, "mine-sql") == want
    assert loads(thread) == 1  # the new adapter was mounted on the loaded base
    seed = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "SELECT 1;"}]
    again = c.create(
        model="mine-sql2", from_="coder", adapters=files, system="Be brief.", messages=seed
    )
    assert again.status == "success"
    show = httpx.post(f"{server.base_url}/api/show", json={"model": "mine-sql2"}).json()
    assert "ADAPTER " in show["modelfile"] and show["system"] == "Be brief."
    assert show["messages"] == seed
    base_show = httpx.post(f"{server.base_url}/api/show", json={"model": "coder"}).json()
    assert show["modified_at"] > base_show["modified_at"]  # as new as its uploaded adapter
    entry = load_registry_file(Path(os.environ["MLXD_HOME"]) / "models.yaml")["mine-sql2:latest"]
    assert (
        entry.adapters
        == load_registry_file(Path(os.environ["MLXD_HOME"]) / "models.yaml")[
            "mine-sql:latest"
        ].adapters
    )  # one directory per distinct upload


def test_a_blob_damaged_on_disk_is_taken_for_absent_and_uploaded_again(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    server, _ = served
    c = client(server)
    want = answer(server, "coder-sql")
    files = upload(c, adapters.sql)
    assert c.create(model="fine", from_="coder", adapters=files).status == "success"
    digest = files["adapters.safetensors"]
    blob = Path(os.environ["MLXD_HOME"]) / "blobs" / digest.replace(":", "-")
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in place, same size: the adapter directory's link too
    blob.write_bytes(bytes(data))
    head = httpx.head(f"{server.base_url}/api/blobs/{digest}")
    assert head.status_code == 404
    with pytest.raises(ollama.ResponseError, match="damaged"):
        c.create(model="broken", from_="coder", adapters=files)
    assert "broken:latest" not in tags(server)
    assert c.create_blob(adapters.sql / "adapters.safetensors") == digest  # sent again
    assert httpx.head(f"{server.base_url}/api/blobs/{digest}").status_code == 200
    assert c.create(model="mended", from_="coder", adapters=files).status == "success"
    assert answer(server, "mended") == want


def test_modelfile_create_raw_and_from_the_cli_and_show_modelfile_recreates_it(
    served: tuple[RunningServer, ServerThread], adapters: Adapters, tmp_path: Path
) -> None:
    server, thread = served
    want = answer(server, "coder-tests")
    modelfile = f"FROM coder\nADAPTER {adapters.tests}\nPARAMETER temperature 0\nSYSTEM terse\n"
    r = httpx.post(
        f"{server.base_url}/api/create", json={"model": "mf", "modelfile": modelfile}, timeout=60
    )
    assert r.status_code == 200
    lines = [json.loads(x)["status"] for x in r.text.splitlines()]
    assert lines[0] == "parsing modelfile" and lines[-1] == "success"
    assert answer(server, "mf") == want

    # `mlxd create` with a relative ADAPTER path: the files are uploaded as blobs
    folder = tmp_path / "proj"
    shutil.copytree(adapters.tests, folder / "adapter")
    (folder / "Modelfile").write_text("FROM coder\nADAPTER ./adapter\n", encoding="utf-8")
    out = cli(["create", "fromcli", "-f", str(folder / "Modelfile")], server)
    assert out.returncode == 0, out.stderr
    assert "success" in out.stderr
    assert answer(server, "fromcli") == want

    shown = cli(["show", "--modelfile", "fromcli"], server)
    assert shown.returncode == 0 and "ADAPTER " in shown.stdout
    (tmp_path / "Again").write_text(shown.stdout, encoding="utf-8")
    again = cli(["create", "again", "-f", str(tmp_path / "Again")], server)
    assert again.returncode == 0, again.stderr
    assert answer(server, "again") == want
    # a scale only the Modelfile says: the folder is named, not uploaded, and the scale kept
    (folder / "Scaled").write_text("FROM coder\nADAPTER ./adapter scale=0.0\n", encoding="utf-8")
    scaled = cli(["create", "scaled", "-f", str(folder / "Scaled")], server)
    assert scaled.returncode == 0, scaled.stderr
    [ref] = thread.state.registry().get("scaled").adapters
    assert ref.scale == 0.0 and Path(ref.ref) == (folder / "adapter").resolve()
    assert answer(server, "scaled") == answer(server, "coder")  # a zero scale: the base's
    assert loads(thread) == 1


def test_bad_input_is_refused_and_nothing_is_registered(
    served: tuple[RunningServer, ServerThread],
    adapters: Adapters,
    tiny_pair: TinyPair,
    tmp_path: Path,
) -> None:
    server, _ = served
    base = server.base_url
    data = (adapters.sql / "adapter_config.json").read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    wrong = "sha256:" + "0" * 64
    assert httpx.head(f"{base}/api/blobs/{digest}").status_code == 404
    r = httpx.post(f"{base}/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{base}/api/blobs/{wrong}").status_code == 404
    r = httpx.post(f"{base}/api/blobs/sha256:xyz", content=data)
    assert r.status_code == 400 and r.json()["error"] == "invalid digest format"
    assert httpx.post(f"{base}/api/blobs/{digest}", content=data).status_code == 201
    assert httpx.post(f"{base}/api/blobs/{digest}", content=data).status_code == 200
    assert httpx.head(f"{base}/api/blobs/{digest}").status_code == 200

    def create(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{base}/api/create", json={"model": "bad", **body}, timeout=60)

    c = client(server)
    weights = c.create_blob(adapters.sql / "adapters.safetensors")
    other = upload(c, adapters.other_base)
    corrupt = tmp_path / "adapters.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    config = json.loads((Path(tiny_pair.target) / "config.json").read_text())
    embedding = tmp_path / "embedding"  # mlx-lm's tuner can adapt the token embedding
    embedding.mkdir()
    mx.save_safetensors(
        str(embedding / "adapters.safetensors"),
        {  # as its LoRAEmbedding saves them: A (vocabulary, r), B (r, hidden)
            "model.embed_tokens.lora_a": mx.zeros((config["vocab_size"], 4)),
            "model.embed_tokens.lora_b": mx.zeros((4, config["hidden_size"])),
        },
    )
    (embedding / "adapter_config.json").write_bytes(
        (adapters.sql / "adapter_config.json").read_bytes()
    )
    on_embedding = upload(c, embedding)
    cut = tmp_path / "cut" / "adapters.safetensors"  # a copy cut short: its header is whole
    cut.parent.mkdir()
    cut.write_bytes((adapters.sql / "adapters.safetensors").read_bytes()[:-100])
    cases = [
        ({"from": "nope"}, 404, "model 'nope' not found"),
        ({}, 400, "neither 'from' or 'files' was specified"),
        ({"from": "coder", "adapters": other}, 400, "does not fit this base model"),
        ({"from": "coder", "adapters": on_embedding}, 400, "is an embedding"),
        ({"from": "coder", "adapters": {"adapters.safetensors": weights}}, 400, "missing"),
        ({"from": "coder", "adapters": {"adapter_config.json": wrong}}, 404, "not found"),
        (
            {
                "from": "coder",
                "adapters": {
                    "adapter_config.json": digest,
                    "adapters.safetensors": c.create_blob(corrupt),
                },
            },
            400,
            "the uploaded adapter's adapters.safetensors is corrupt",
        ),
        (
            {
                "from": "coder",
                "adapters": {
                    "adapter_config.json": digest,
                    "adapters.safetensors": c.create_blob(cut),
                },
            },
            400,
            "truncated",
        ),
        (
            {"modelfile": f"FROM coder\nADAPTER {adapters.dora}\nADAPTER {adapters.sql}\n"},
            400,
            "DoRA adapters cannot be combined",
        ),
        ({"from": "coder", "parameters": {"temprature": 1}}, 400, "unknown parameter"),
        ({"modelfile": "FROM coder\nADAPTER /no/such/dir\n"}, 400, "not a directory"),
        ({"modelfile": "FROM coder\nFROBNICATE x\n"}, 400, "unknown command"),
        ({"from": str(tmp_path)}, 400, "holds no model"),  # a directory, but no model in it
    ]
    for body, status, message in cases:
        r = create(body)
        assert r.status_code == status, (body, r.text)
        assert message in r.json()["error"], (body, r.text)
    assert "bad:latest" not in tags(server)
    user = Path(os.environ["MLXD_HOME"]) / "models.yaml"
    assert not user.exists() or "bad" not in load_registry_file(user)
    adapters_dir = Path(os.environ["MLXD_HOME"]) / "adapters"
    assert not adapters_dir.exists() or not any(adapters_dir.iterdir())


def test_a_new_draft_keeps_the_draft_adapters_only_where_they_fit_it(
    tiny_pair: TinyPair, adapters: Adapters, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DRAFT` replacing the draft of an entry with `draft_adapters`: they stay where they fit
    the new draft, and are refused (nothing registered) where they do not, rather than every
    request on the model failing."""
    home = tmp_path / "home"
    monkeypatch.setenv("MLXD_HOME", str(home))
    base = tmp_path / "base.yaml"
    base.write_text(
        f"models:\n  drafted:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"    draft_adapters: [{adapters.draft}]\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("MLXD_REGISTRY", f"{base}{os.pathsep}{home / 'models.yaml'}")
    with ServerThread(None) as server:  # type: ignore[arg-type]

        def create(name: str, draft: Path) -> httpx.Response:
            body = {"model": name, "modelfile": f"FROM drafted\nDRAFT {draft}\n"}
            return httpx.post(f"{server.base_url}/api/create", json=body, timeout=60)

        refused = create("other-draft", Path(tiny_pair.target))  # shaped as the target
        assert refused.status_code == 400, refused.text
        assert "do not fit the new draft" in refused.json()["error"]
        assert "other-draft:latest" not in tags(server)
        kept = create("same-shape", Path(tiny_pair.draft))
        assert kept.status_code == 200, kept.text
        assert answer(server, "same-shape")


def test_hostile_input_to_create_is_a_400_and_text_comes_back_as_sent(
    served: tuple[RunningServer, ServerThread], adapters: Adapters, tmp_path: Path
) -> None:
    """Input a local page or process can send: each was a 500 (or a model every request then
    refused, or text changed on the way to the registry file)."""
    server, _ = served
    base = server.base_url
    config = (adapters.sql / "adapter_config.json").read_bytes()
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    assert httpx.post(f"{base}/api/blobs/{digest}%0A", content=config).status_code == 400
    assert httpx.head(f"{base}/api/blobs/{digest}%0A").status_code == 400
    c = client(server)
    weights = c.create_blob(adapters.sql / "adapters.safetensors")
    deep = tmp_path / "adapter_config.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    nan = tmp_path / "nan" / "adapter_config.json"
    nan.parent.mkdir()
    nan.write_text(json.dumps({**json.loads(config), "lora_parameters": {"scale": 1e999}}))
    cases = [
        {"adapters": {"adapter_config.json": c.create_blob(deep), "adapters.safetensors": weights}},
        {"adapters": {"adapter_config.json": c.create_blob(nan), "adapters.safetensors": weights}},
        {"adapters": {"a\0b": digest}},
        {"adapters": {"x" * 300: digest}},
        {"modelfile": 'FROM coder\nSYSTEM "\\ud800"'},
        {"modelfile": "FROM coder\nADAPTER ~nosuchuser/x"},
        {"modelfile": "FROM coder\nDRAFT /" + "a" * 5000},
        {"modelfile": "FROM coder\nADAPTER x", "path": "~nosuchuser/Modelfile"},
        {"from": "~nosuchuser/x"},
        {"parameters": {"min_p": 7}},
        {"parameters": {"seed": 2**70}},
        {"modelfile": "FROM coder\nPARAMETER temperature nan"},
    ]
    for body in cases:
        r = httpx.post(
            f"{base}/api/create", json={"model": "bad", "from": "coder", **body}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"], (body, r.text)
    assert "bad:latest" not in tags(server)
    text = "a\x85b\u2028c\nd\x85"  # breaks a YAML reader takes wherever they stand bare
    made = {
        "model": "odd",
        "from": "coder",
        "system": text,
        "messages": [{"role": "user", "content": text}],
    }
    assert httpx.post(f"{base}/api/create", json=made, timeout=60).status_code == 200
    shown = httpx.post(f"{base}/api/show", json={"model": "odd"}).json()
    assert shown["system"] == text and shown["messages"][0]["content"] == text


def test_a_created_model_is_a_new_model_with_its_license(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """As Ollama's create writes a new manifest: the model is listed first (modified now, not
    when its base's files were), has its own ID where its settings differ, and keeps the
    license it was given (a copy keeps the ID: nothing differs)."""
    server, _ = served
    base = server.base_url
    c = client(server)
    c.create(model="licensed", from_="coder", license=["MIT", "Apache-2.0"], system="Be brief.")
    modelfile = 'FROM coder\nLICENSE """BSD\nthree clauses"""\n'
    assert (
        httpx.post(f"{base}/api/create", json={"model": "bsd", "modelfile": modelfile}).status_code
        == 200
    )
    shown = c.show("licensed")
    assert shown.license == "MIT\nApache-2.0"
    assert 'LICENSE """MIT"""' in (shown.modelfile or "")
    assert c.show("bsd").license == "BSD\nthree clauses"
    assert (
        httpx.post(f"{base}/api/copy", json={"source": "coder", "destination": "again"}).status_code
        == 200
    )
    listed = {m.model: m for m in c.list().models}
    assert [m.model for m in c.list().models][:3] == [
        "again:latest",
        "bsd:latest",
        "licensed:latest",
    ]
    assert listed["licensed:latest"].digest != listed["coder:latest"].digest
    assert listed["again:latest"].digest == listed["coder:latest"].digest
    assert listed["again:latest"].modified_at > listed["coder:latest"].modified_at


def test_a_home_that_cannot_be_written_answers_a_plain_500(
    served: tuple[RunningServer, ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    """The server's own trouble (a read-only or full home) is a 500 with its reason, as copy
    and delete answer it, not an error the route lets escape (two tracebacks a request)."""
    server, _ = served
    home = Path(os.environ["MLXD_HOME"])
    shutil.rmtree(home / "blobs", ignore_errors=True)
    (home / "blobs").write_text("not a folder")  # the blob store cannot be made
    (home / ".models.yaml.lock").mkdir()  # registry edits cannot take their lock
    data = b"hello"
    with caplog.at_level(logging.ERROR):
        blob = httpx.post(
            f"{server.base_url}/api/blobs/sha256:{hashlib.sha256(data).hexdigest()}", content=data
        )
        made = httpx.post(
            f"{server.base_url}/api/create", json={"model": "c", "from": "coder", "system": "s"}
        )
    assert (blob.status_code, made.status_code) == (500, 500)
    assert blob.json()["error"].startswith("could not store the blob") and made.json()["error"]
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_an_upload_ends_when_the_daemon_is_told_to_stop(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """A blob arriving slowly ends with 503 at the stop (it held the shutdown for uvicorn's
    graceful timeout, then was cut), and nothing of it is kept."""
    server, thread = served
    told = threading.Event()

    def chunks() -> Iterator[bytes]:
        yield b"x" * 4096
        thread.state.stop_serving()
        told.set()
        for _ in range(50):
            time.sleep(0.1)
            yield b"x" * 4096

    digest = "sha256:" + "0" * 64
    r = httpx.post(f"{server.base_url}/api/blobs/{digest}", content=chunks(), timeout=60)
    assert told.is_set()
    assert r.status_code == 503 and r.json() == {"error": "mlxd is shutting down"}
    blobs = Path(os.environ["MLXD_HOME"]) / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []


def test_a_model_shipped_in_the_package_is_a_base_to_create_from(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """`from` an entry whose target is the package's own model (`embedded:...`, as the
    default registry's `tiny`): created, listed, and answering as its base does."""
    server, _ = served
    r = httpx.post(
        f"{server.base_url}/api/create",
        json={"model": "mine", "from": "shipped", "system": "be brief", "stream": False},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    assert "mine:latest" in tags(server)
    assert answer(server, "mine") == answer(server, "shipped")  # raw: the system is not used
    written = (Path(os.environ["MLXD_HOME"]) / "models.yaml").read_text(encoding="utf-8")
    assert "target: embedded:tiny/target" in written  # portable, not this install's path


def cli(args: list[str], server: RunningServer) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("OLLAMA_HOST", None)
    env["MLXD_HOST"] = f"127.0.0.1:{server.port}"
    return subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_created_models_messages_open_generate_and_yield_to_a_requests_system(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """The model's MESSAGE lines open `/api/generate` and `/v1/completions` too (after the
    system prompt, as Ollama renders a generate without `context`); a chat whose request
    opens with its own system message drops the model's SYSTEM, as Ollama decides it on the
    request's first message (the seed's was looked at, so both were kept)."""
    server, _ = served
    base = server.base_url
    seed = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    for name, messages in (("seeded", seed), ("unseeded", None)):
        body = {"model": name, "from": "coder", "system": "SYS", "messages": messages}
        assert httpx.post(f"{base}/api/create", json=body, timeout=60).status_code == 200

    def rendered(route: str, **body: object) -> str:
        r = httpx.post(f"{base}/api/{route}", json={**body, "_debug_render_only": True})
        assert r.status_code == 200, r.text
        return str(r.json()["_debug_info"]["rendered_template"])

    text = rendered("generate", model="seeded", prompt="write fib", stream=False)
    assert text.index("SYS") < text.index("hello") < text.index("hi there") < text.index("fib")
    own = [{"role": "system", "content": "REQSYS"}, {"role": "user", "content": "write fib"}]
    text = rendered("chat", model="seeded", messages=own, stream=False)
    assert "SYS" not in text.replace("REQSYS", "")
    assert text.index("hello") < text.index("hi there") < text.index("REQSYS")
    mine = [{"role": "user", "content": "write fib"}]
    text = rendered("chat", model="seeded", messages=mine, stream=False)
    assert text.index("SYS") < text.index("hello") < text.index("fib")

    def counted(model: str) -> tuple[int, int]:
        options = {"num_predict": 1, "temperature": 0}
        ollama_body = {"model": model, "prompt": "write fib", "stream": False, "options": options}
        native = httpx.post(f"{base}/api/generate", json=ollama_body, timeout=60).json()
        openai_body = {"model": model, "prompt": "write fib", "max_tokens": 1, "temperature": 0}
        usage = httpx.post(f"{base}/v1/completions", json=openai_body, timeout=60).json()["usage"]
        return native["prompt_eval_count"], usage["prompt_tokens"]

    seeded, unseeded = counted("seeded"), counted("unseeded")
    assert seeded[0] == seeded[1] > unseeded[0] == unseeded[1]


def test_create_takes_a_messages_roles_as_chat_does_and_refuses_others(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """A role other than system, user or assistant was a 500 (the registry refused the
    entry as it was written); a capitalised one is taken lower-cased, as a chat takes it."""
    server, thread = served
    base = server.base_url
    for role in ("wizard", "tool"):
        body = {"model": "roles", "from": "coder", "messages": [{"role": role, "content": "x"}]}
        r = httpx.post(f"{base}/api/create", json=body, timeout=60)
        assert r.status_code == 400 and role in r.json()["error"], r.text
    image = {"role": "user", "content": "x", "images": ["aGk="]}  # dropped without a word
    body = {"model": "roles", "from": "coder", "messages": [image]}
    r = httpx.post(f"{base}/api/create", json=body, timeout=60)
    assert r.status_code == 400 and "does not support images" in r.json()["error"], r.text
    assert "roles:latest" not in tags(server)
    body = {"model": "roles", "from": "coder", "messages": [{"role": "User", "content": "x"}]}
    assert httpx.post(f"{base}/api/create", json=body, timeout=60).status_code == 200
    assert wait_for(lambda: "roles:latest" in tags(server))
    assert thread.state.registry().get("roles").messages[0]["role"] == "user"


def test_creating_or_copying_over_a_model_removes_the_adapter_files_only_it_used(
    served: tuple[RunningServer, ServerThread], adapters: Adapters
) -> None:
    """As Ollama removes a replaced model's unused layers: the uploaded adapter's folder and
    blobs stayed behind when a create replaced the only model on them."""
    server, _ = served
    c = client(server)
    files = upload(c, adapters.tests)
    c.create(model="replaced", from_="coder", adapters=files)
    folders = Path(os.environ["MLXD_HOME"]) / "adapters"
    assert len(list(folders.iterdir())) == 1
    c.create(model="kept", from_="coder", adapters=files)
    c.create(model="replaced", from_="coder")  # "kept" still uses the folder
    assert len(list(folders.iterdir())) == 1
    c.copy("replaced", "kept")  # a copy over the last model on them: gone too
    assert not list(folders.iterdir())
    blobs = Path(os.environ["MLXD_HOME"]) / "blobs"
    assert not [b for b in blobs.iterdir() if b.name.endswith(files["adapters.safetensors"][7:])]


def test_creating_over_a_model_named_in_another_case_keeps_its_name(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """Names match whatever their case, and a replaced model keeps the name it was stored
    under, as Ollama canonicalises to the stored casing (it was renamed)."""
    server, thread = served
    c = client(server)
    c.create(model="Mixed", from_="coder", system="one")
    c.create(model="mixed", from_="coder", system="two")
    assert "Mixed:latest" in tags(server) and "mixed:latest" not in tags(server)
    assert thread.state.registry().get("MIXED").system == "two"


def test_create_reads_parameters_as_a_request_reads_options(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """null leaves a parameter unset and a fractional number for a whole-number one takes
    its integer part, as a request's options (and Ollama's create) read them: both were 400s."""
    server, thread = served
    parameters = {"num_predict": 7.9, "top_k": 3.0, "temperature": None}
    body = {"model": "params", "from": "coder", "parameters": parameters}
    r = httpx.post(f"{server.base_url}/api/create", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert wait_for(lambda: "params:latest" in tags(server))
    assert dict(thread.state.registry().get("params").options) == {"num_predict": 7, "top_k": 3}


def test_the_models_system_comes_first_where_its_seed_opens_with_a_system_message(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """As Ollama decides it on the request's first message: a seed's own system message
    does not take the model's SYSTEM away (a chat lost it; a generate kept it)."""
    server, _ = served
    base = server.base_url
    seed = [{"role": "system", "content": "SEEDSYS"}, {"role": "user", "content": "hello"}]
    body = {"model": "sys-seed", "from": "coder", "system": "MODELSYS", "messages": seed}
    assert httpx.post(f"{base}/api/create", json=body, timeout=60).status_code == 200
    chat = {"model": "sys-seed", "messages": [{"role": "user", "content": "fib"}]}
    for route, request in (("chat", chat), ("generate", {"model": "sys-seed", "prompt": "fib"})):
        r = httpx.post(f"{base}/api/{route}", json={**request, "_debug_render_only": True})
        text = r.json()["_debug_info"]["rendered_template"]
        assert text.index("MODELSYS") < text.index("SEEDSYS") < text.index("fib"), route


def test_create_and_copy_to_a_hub_models_short_name_make_a_model_of_their_own(
    served: tuple[RunningServer, ServerThread],
) -> None:
    """`org/repo` finds a pulled `hf.co/org/repo` for a run or a pull, but a create or copy
    under `org/repo` is another model: it was written over the pulled one."""
    server, thread = served
    add_entry(served, "hf.co/org/repo", "")
    c = client(server)
    c.create(model="org/repo", from_="coder", system="mine")
    c.copy("coder-sql", "org/other")
    add_entry(served, "hf.co/org/other", "")
    c.copy("coder-sql", "org/other")
    names = tags(server)
    assert {"hf.co/org/repo:latest", "org/repo:latest", "org/other:latest"} <= set(names)
    assert "hf.co/org/other:latest" in names
    registry = thread.state.registry()
    assert registry.get("hf.co/org/repo").system is None
    assert registry.get("hf.co/org/other").adapters == ()
