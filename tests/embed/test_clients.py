"""The embedding routes through real clients against a real server: ollama-python, openai,
LangChain's OllamaEmbeddings, LiteLLM, and the request shapes Open WebUI and Continue send."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.conftest import RunningServer, ServerThread, wait_for
from tests.daemon.test_cli import mlxd as mlxd_cli
from tests.embed.conftest import model_dirs
from tests.embed.reference import Reference
from tests.fixtures.tiny_embedders import TinyEmbedders

pytestmark = pytest.mark.filterwarnings("ignore:Items? .*ReadOnly:UserWarning")

DOCS = ["Why is the sky blue?", "Llamas are members of the camelid family", "hello world"]


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def refs(embedders: TinyEmbedders) -> dict[str, Reference]:
    dirs = model_dirs(embedders)
    return {
        "minilm": Reference(dirs["minilm"], "mean"),
        "bge": Reference(dirs["bge"], "cls"),
        "nomic": Reference(dirs["nomic"], "mean"),
        "qwen3-embedding": Reference(dirs["qwen3-embedding"], "last"),
        "plain-encoder": Reference(dirs["minilm"], "cls"),
    }


@pytest.fixture(scope="module")
def client(embed_server: RunningServer) -> ollama.Client:
    return ollama.Client(host=embed_server.base_url)


@pytest.mark.parametrize("name", ["minilm", "bge", "nomic", "qwen3-embedding", "plain-encoder"])
def test_ollama_embed(client: ollama.Client, refs: dict[str, Reference], name: str) -> None:
    out = client.embed(model=name, input=DOCS)
    assert out.model == name
    expected = np.stack([refs[name].embed(t) for t in DOCS])
    np.testing.assert_allclose(np.array(out.embeddings), expected, atol=5e-5)
    assert out.prompt_eval_count == sum(len(refs[name].ids(t)) for t in DOCS)
    assert out.total_duration and out.total_duration >= (out.load_duration or 0)
    one_by_one = [client.embed(model=name, input=t).embeddings[0] for t in DOCS]
    np.testing.assert_allclose(np.array(out.embeddings), np.array(one_by_one), atol=1e-5)
    same = client.embed(model=name, input=[DOCS[0], DOCS[0]]).embeddings
    assert cosine(same[0], same[1]) == pytest.approx(1.0, abs=1e-6)


def test_ollama_embed_options(client: ollama.Client, refs: dict[str, Reference]) -> None:
    cut = client.embed(model="minilm", input="hello world", dimensions=8).embeddings[0]
    assert len(cut) == 8 and np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-6)
    long = " ".join(["sky"] * 100)
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="minilm", input=long, truncate=False)
    assert err.value.status_code == 400
    assert "the input length exceeds the context length" in err.value.error
    out = client.embed(model="minilm", input=long, options={"num_ctx": 12}, keep_alive="1m")
    assert out.prompt_eval_count == 12


def test_ollama_embeddings_legacy(client: ollama.Client, refs: dict[str, Reference]) -> None:
    out = client.embeddings(model="bge", prompt=DOCS[0])
    np.testing.assert_allclose(out.embedding, refs["bge"].embed(DOCS[0]), atol=5e-5)
    assert client.embeddings(model="bge", prompt="").embedding == []


def test_empty_input_loads_the_model(embed_server: RunningServer, client: ollama.Client) -> None:
    r = httpx.post(f"{embed_server.base_url}/api/embed", json={"model": "nomic"})
    assert r.status_code == 200 and r.json() == {"model": "nomic", "embeddings": []}
    assert "nomic:latest" in [m.model for m in client.ps().models]
    r = httpx.post(f"{embed_server.base_url}/api/embed", json={"model": "nomic", "keep_alive": 0})
    assert r.status_code == 200
    assert "nomic:latest" not in [m.model for m in client.ps().models]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "minilm", "input": 3}, 400, "invalid input type"),
        ({"model": "minilm", "input": ["a", 3]}, 400, "invalid input type"),
        ({"model": "minilm", "input": "a", "dimensions": -1}, 400, "dimensions"),
        ({"input": "a"}, 400, "model is required"),
        ({"model": "nope", "input": "a"}, 404, "not found"),
        ({"model": "tiny", "input": "a"}, 501, "this model does not support embeddings"),
        ({"model": "minilm", "input": "a", "keep_alive": "3600"}, 400, "missing unit"),
    ],
)
def test_embed_errors(
    embed_server: RunningServer, body: dict[str, Any], status: int, message: str
) -> None:
    r = httpx.post(f"{embed_server.base_url}/api/embed", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]


def test_generative_model_refuses_without_loading(
    embed_server: RunningServer, client: ollama.Client
) -> None:
    for path in ("/api/embed", "/api/embeddings"):
        body = {"model": "tiny", "input": "a", "prompt": "a"}
        r = httpx.post(embed_server.base_url + path, json=body, timeout=60)
        assert r.status_code == 501
        assert r.json() == {"error": "this model does not support embeddings"}
    assert "tiny:latest" not in [m.model for m in client.ps().models]


def test_embedding_model_does_not_generate(
    embed_server: RunningServer, client: ollama.Client
) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="minilm", prompt="hello")
    assert err.value.status_code == 400
    assert err.value.error == '"minilm:latest" does not support generate'
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="minilm", messages=[{"role": "user", "content": "hi"}])
    assert err.value.error == '"minilm:latest" does not support chat'
    oa = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="x")
    with pytest.raises(openai.BadRequestError, match="does not support chat"):
        oa.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    # an empty prompt asks to load a model for generating: refused alike, as Ollama does
    for path, body, what in (
        ("/api/generate", {"prompt": ""}, "generate"),
        ("/api/chat", {"messages": []}, "chat"),
    ):
        r = httpx.post(embed_server.base_url + path, json={"model": "minilm", **body}, timeout=60)
        assert r.status_code == 400, path
        assert r.json() == {"error": f'"minilm:latest" does not support {what}'}


def test_show_capabilities(client: ollama.Client) -> None:
    assert client.show("minilm").capabilities == ["embedding"]
    assert client.show("qwen3-embedding").capabilities == ["embedding"]
    assert "completion" in (client.show("tiny").capabilities or [])


# -- OpenAI ---------------------------------------------------------------------------------------


def test_openai_embeddings(embed_server: RunningServer, refs: dict[str, Reference]) -> None:
    oa = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="x")
    out = oa.embeddings.create(model="bge", input=DOCS, encoding_format="float")
    expected = np.stack([refs["bge"].embed(t) for t in DOCS])
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), expected, atol=5e-5)
    assert [d.index for d in out.data] == [0, 1, 2]
    assert (
        out.usage.prompt_tokens
        == out.usage.total_tokens
        == sum(len(refs["bge"].ids(t)) for t in DOCS)
    )
    # the SDK's default asks for base64 and decodes it itself
    default = oa.embeddings.create(model="bge", input=DOCS)
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), expected, atol=5e-5)
    raw = httpx.post(
        embed_server.base_url + "/v1/embeddings",
        json={"model": "bge", "input": DOCS[0], "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=5e-5)
    cut = oa.embeddings.create(model="bge", input="hello", dimensions=4)
    assert len(cut.data[0].embedding) == 4


def test_openai_token_arrays(embed_server: RunningServer, refs: dict[str, Reference]) -> None:
    oa = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="x")
    ids = refs["minilm"].ids("hello world")
    out = oa.embeddings.create(model="minilm", input=[ids, ids[:3]], encoding_format="float")
    np.testing.assert_allclose(
        out.data[0].embedding, refs["minilm"].embed("hello world"), atol=5e-5
    )
    np.testing.assert_allclose(out.data[1].embedding, refs["minilm"].embed_ids(ids[:3]), atol=5e-5)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "minilm", "input": []}, 400, "invalid input"),
        ({"model": "minilm"}, 400, "invalid input"),
        ({"model": "minilm", "input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"model": "tiny", "input": "a"}, 501, "does not support embeddings"),
        ({"model": "minilm", "input": [[1, 99999]]}, 400, "out of range"),
    ],
)
def test_openai_errors(
    embed_server: RunningServer,
    body: dict[str, Any],
    status: int,
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each a deliberate answer (a 501 for a model that does not embed, as Ollama's), so
    nothing is logged as a server fault."""
    with caplog.at_level(logging.ERROR):
        r = httpx.post(f"{embed_server.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert not caplog.records, caplog.text


# -- client libraries -----------------------------------------------------------------------------


def test_langchain_ollama_embeddings(
    embed_server: RunningServer, refs: dict[str, Reference]
) -> None:
    langchain_ollama = pytest.importorskip("langchain_ollama")
    emb = langchain_ollama.OllamaEmbeddings(
        model="nomic", base_url=embed_server.base_url, validate_model_on_init=True
    )
    docs = emb.embed_documents(DOCS)
    np.testing.assert_allclose(
        np.array(docs), np.stack([refs["nomic"].embed(t) for t in DOCS]), atol=5e-5
    )
    query = emb.embed_query(DOCS[1])
    assert cosine(query, docs[1]) == pytest.approx(1.0, abs=1e-6)


def test_litellm_ollama_embeddings(embed_server: RunningServer, refs: dict[str, Reference]) -> None:
    litellm = pytest.importorskip("litellm")
    out = litellm.embedding(
        model="ollama/qwen3-embedding", input=DOCS, api_base=embed_server.base_url
    )
    vectors = np.array([d["embedding"] for d in out.data])
    expected = np.stack([refs["qwen3-embedding"].embed(t) for t in DOCS])
    np.testing.assert_allclose(vectors, expected, atol=5e-5)


def test_open_webui_request_shapes(embed_server: RunningServer, refs: dict[str, Reference]) -> None:
    """Open WebUI's RAG: /api/embed with an input list, a bearer key and its user headers; with
    RAG_EMBEDDING_PREFIX_FIELD_NAME set it sends the prefix in that field; its OpenAI engine
    posts to /v1/embeddings."""
    headers = {
        "Authorization": "Bearer sk-local",
        "X-OpenWebUI-User-Name": "Ada",
        "X-OpenWebUI-User-Id": "1",
        "X-OpenWebUI-User-Email": "ada@example.com",
        "X-OpenWebUI-User-Role": "admin",
    }
    url = embed_server.base_url
    r = httpx.post(f"{url}/api/embed", json={"input": DOCS, "model": "nomic"}, headers=headers)
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["embeddings"][2], refs["nomic"].embed(DOCS[2]), atol=5e-5)
    body = {"input": [DOCS[0]], "model": "nomic", "prefix": "query", "truncate": True}
    r = httpx.post(f"{url}/api/embed", json=body, headers=headers)
    np.testing.assert_allclose(
        r.json()["embeddings"][0], refs["nomic"].embed("search_query: " + DOCS[0]), atol=5e-5
    )
    r = httpx.post(f"{url}/v1/embeddings", json={"input": DOCS, "model": "nomic"}, headers=headers)
    assert [len(d["embedding"]) for d in r.json()["data"]] == [32, 32, 32]


def test_continue_request_shape(embed_server: RunningServer, refs: dict[str, Reference]) -> None:
    """Continue's indexer posts chunks to /api/embed in batches of up to 64 and needs a
    non-empty `embeddings` back."""
    chunks = [f"def f{i}(x):\n    return x + {i}\n" for i in range(70)]
    url = embed_server.base_url
    got: list[list[float]] = []
    for start in range(0, len(chunks), 64):
        r = httpx.post(
            f"{url}/api/embed", json={"model": "minilm", "input": chunks[start : start + 64]}
        )
        assert r.status_code == 200
        got += r.json()["embeddings"]
    assert len(got) == 70
    np.testing.assert_allclose(got[65], refs["minilm"].embed(chunks[65]), atol=5e-5)


def test_concurrent_requests_share_forwards(embed_server: RunningServer) -> None:
    """Requests that arrive together are embedded in shared forwards; each still gets its own
    vectors, in its own order, and its own token count."""
    import concurrent.futures

    url = f"{embed_server.base_url}/api/embed"
    bodies = [{"model": "bge", "input": DOCS[i:] + DOCS[:i], "dimensions": 8 + i} for i in range(3)]
    bodies += [{"model": "bge", "input": "sky " * 100, "truncate": False}]  # fails alone
    alone = [httpx.post(url, json=b, timeout=120) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(len(bodies) * 2) as pool:
        together = list(pool.map(lambda b: httpx.post(url, json=b, timeout=120), bodies * 2))
    for got, want in zip(together, alone * 2, strict=True):
        assert got.status_code == want.status_code
        if want.status_code == 200:
            np.testing.assert_allclose(
                got.json()["embeddings"], want.json()["embeddings"], atol=1e-5
            )
            assert got.json()["prompt_eval_count"] == want.json()["prompt_eval_count"]
        else:
            assert got.json() == want.json()


def test_show_and_ps_give_an_embedders_one_context_length(client: ollama.Client) -> None:
    """A rotary embedder serves up to its known length, not its config's positions: `show`
    says what `ps` says and what a request may use."""
    client.embed(model="qwen3-embedding", input="hi")
    shown = client.show("qwen3-embedding")
    running = [m for m in client.ps().models if m.model == "qwen3-embedding:latest"]
    assert running and shown.details is not None and shown.modelinfo is not None
    length = shown.modelinfo["qwen3.context_length"]
    assert length == running[0].context_length


def test_mlxd_run_prints_an_embedding_models_vector(
    embed_server: RunningServer, client: ollama.Client
) -> None:
    """As `ollama run` on an embedding model: the input's vector as JSON; no input: a usage
    error."""
    want = client.embed(model="minilm", input="the sky is blue").embeddings[0]
    result = mlxd_cli(["run", "minilm", "the sky is blue"], embed_server.port)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == pytest.approx(want, abs=1e-6)
    piped = mlxd_cli(["run", "minilm"], embed_server.port, stdin="the sky is blue")
    assert json.loads(piped.stdout) == pytest.approx(want, abs=1e-6)
    empty = mlxd_cli(["run", "minilm"], embed_server.port, stdin="")
    assert empty.returncode == 1 and b"embedding models require input text" in empty.stderr


def test_mlxd_run_takes_ollamas_embedding_flags(
    embed_server: RunningServer, client: ollama.Client
) -> None:
    """`--dimensions N` (the first N, renormalized) and `--truncate=false` (an input past the
    context refused), as `ollama run` passes them to /api/embed."""
    want = client.embed(model="minilm", input="the sky is blue", dimensions=8).embeddings[0]
    short = mlxd_cli(["run", "minilm", "--dimensions", "8", "the sky is blue"], embed_server.port)
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout) == pytest.approx(want, abs=1e-6) and len(want) == 8
    long = "the sky is blue " * 400
    cut = mlxd_cli(["run", "minilm", "--truncate", long], embed_server.port)
    assert cut.returncode == 0, cut.stderr
    refused = mlxd_cli(["run", "minilm", "--truncate=false", long], embed_server.port)
    assert refused.returncode == 1 and b"context length" in refused.stderr


@pytest.fixture(scope="module")
def same_files(
    embedders: TinyEmbedders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Entries on one encoder's files: as it is, narrowed to 8 tokens, and served for
    completion (which it cannot be)."""
    path = tmp_path_factory.mktemp("same-files") / "models.yaml"
    path.write_text(
        f"models:\n  minilm:\n    target: {embedders.bert}\n"
        f"  minilm-ctx8:\n    target: {embedders.bert}\n    options:\n      num_ctx: 8\n"
        f"  bert-gen:\n    target: {embedders.bert}\n    kind: completion\n",
        encoding="utf-8",
    )
    with ServerThread(path) as info:
        yield info


def test_every_route_cuts_at_the_models_own_num_ctx(same_files: RunningServer) -> None:
    """/v1/embeddings reads an entry's options as Ollama's routes do: the same vector; /api/ps
    and /api/show report the context the entry cuts at."""
    text = "why is the sky blue on a clear day, and red at dusk? " * 4
    ollama_route = httpx.post(
        same_files.base_url + "/api/embed", json={"model": "minilm-ctx8", "input": text}
    ).json()
    assert ollama_route["prompt_eval_count"] == 8
    oa = openai.OpenAI(base_url=same_files.base_url + "/v1", api_key="x")
    out = oa.embeddings.create(model="minilm-ctx8", input=text, encoding_format="float")
    assert out.usage.prompt_tokens == 8
    np.testing.assert_allclose(out.data[0].embedding, ollama_route["embeddings"][0], atol=1e-6)
    ps = httpx.get(same_files.base_url + "/api/ps").json()["models"]
    assert [m["context_length"] for m in ps if m["name"] == "minilm-ctx8:latest"] == [8]
    show = httpx.post(same_files.base_url + "/api/show", json={"model": "minilm-ctx8"}).json()
    contexts = [v for k, v in show["model_info"].items() if k.endswith(".context_length")]
    assert contexts == [8]


def test_an_entry_served_as_what_its_files_cannot_be_is_unavailable(
    same_files: RunningServer,
) -> None:
    """Its probe is its own, not the one of an entry on the same files served otherwise."""
    assert wait_for(lambda: not any(
        m.get("status") for m in httpx.get(same_files.base_url + "/api/tags").json()["models"]
    ))  # fmt: skip
    listed = {m["name"]: m for m in httpx.get(same_files.base_url + "/api/tags").json()["models"]}
    assert "unavailable" not in listed["minilm:latest"]
    assert "bert not supported" in listed["bert-gen:latest"]["unavailable"]
