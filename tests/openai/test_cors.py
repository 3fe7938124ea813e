"""CORS and Host checks (DNS-rebinding protection), over HTTP and on the policy itself."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxd.api.cors import CorsPolicy, env_origins, split_host
from tests.conftest import RunningServer, ServerThread


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def test_no_origin_is_not_cors(http: httpx.Client) -> None:
    r = http.get("/api/version")
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_same_origin_is_not_cors(http: httpx.Client, server: RunningServer) -> None:
    r = http.get("/api/version", headers={"Origin": server.base_url})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_disallowed_origin_is_bare_403(http: httpx.Client) -> None:
    for method in ("GET", "OPTIONS"):
        r = http.request(method, "/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403
        assert r.content == b""


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:3000",
        "http://localhost",
        "https://127.0.0.1:8443",
        "http://0.0.0.0:5173",
        "vscode-webview://x",
        "vscode-file://vscode-app",
        "app://obsidian.md",
        "tauri://localhost",
        "file://",
    ],
)
def test_allowed_origin_is_echoed(http: httpx.Client, origin: str) -> None:
    r = http.get("/api/version", headers={"Origin": origin})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert "Origin" in r.headers["vary"]


def test_cors_headers_on_streams_and_errors(http: httpx.Client) -> None:
    origin = {"Origin": "http://localhost:3000"}
    r = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        headers=origin,
    )  # fmt: skip
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = http.get("/v1/models/nope", headers=origin)
    assert r.status_code == 404
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_preflight_is_204_with_allow_headers(http: httpx.Client) -> None:
    r = http.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization,x-stainless-os",
        },
    )
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {
        "authorization",
        "content-type",
        "user-agent",
        "accept",
        "x-requested-with",
        "openai-beta",
        "x-stainless-os",
        "x-stainless-retry-count",
        "x-stainless-timeout",
    } <= allowed
    methods = set(r.headers["access-control-allow-methods"].split(","))
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= methods


@pytest.mark.parametrize(
    "host",
    ["evil.com", "evil.com:80", "attacker.localhost.evil.com", "8.8.8.8", "[2001:4860::1]:1"],
)
def test_foreign_host_is_403_on_loopback(http: httpx.Client, host: str) -> None:
    r = http.get("/api/version", headers={"Host": host})
    assert r.status_code == 403
    assert r.content == b""


@pytest.mark.parametrize(
    "host",
    ["localhost", "127.0.0.1", "[::1]", "0.0.0.0", "10.1.2.3", "192.168.1.20", "app.localhost",
     "printer.local", "db.internal"],
)  # fmt: skip
def test_local_host_is_fine(http: httpx.Client, server: RunningServer, host: str) -> None:
    r = http.get("/api/version", headers={"Host": f"{host}:{server.port}"})
    assert r.status_code == 200
    assert r.json() == {"version": "0.33.0"}


def test_named_local_host_options_is_204(http: httpx.Client, server: RunningServer) -> None:
    r = http.options("/api/version", headers={"Host": f"localhost:{server.port}"})
    assert r.status_code == 204


@pytest.fixture
def example_server(registry_file: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("MLXD_ORIGINS", "https://example.com, chrome-extension://*")
    monkeypatch.setenv("OLLAMA_ORIGINS", "https://ignored.example")
    with ServerThread(registry_file) as info:
        yield info.base_url


def test_mlxd_origins_env_allows_more(example_server: str) -> None:
    with httpx.Client(base_url=example_server, timeout=30) as http:
        for origin in ("https://example.com", "chrome-extension://abcdef", "http://localhost:1"):
            r = http.get("/api/version", headers={"Origin": origin})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == origin
        for origin in ("https://ignored.example", "https://example.com.evil.net"):
            assert http.get("/api/version", headers={"Origin": origin}).status_code == 403


# -- the policy without a server ---------------------------------------------------------------


def test_env_origins_precedence_and_trimming() -> None:
    assert env_origins({"MLXD_ORIGINS": " a , b ", "OLLAMA_ORIGINS": "c"}) == ["a", "b"]
    assert env_origins({"OLLAMA_ORIGINS": '"c,d"'}) == ["c", "d"]
    assert env_origins({"MLXD_ORIGINS": "  ", "OLLAMA_ORIGINS": "c"}) == ["c"]
    assert env_origins({}) == []


def test_origin_patterns() -> None:
    policy = CorsPolicy.build("127.0.0.1", ["chrome-extension://*", "https://*.example.org"], "box")
    assert policy.origin_allowed("chrome-extension://abc")
    assert policy.origin_allowed("https://app.example.org")
    assert policy.origin_allowed("HTTP://LOCALHOST:8080")
    assert not policy.origin_allowed("https://example.org.evil.com")
    assert not policy.origin_allowed("http://localhost:1.evil.com")
    assert not policy.origin_allowed("http://localhost.evil.com")
    assert not policy.origin_allowed("moz-extension://abc")
    star = CorsPolicy.build("127.0.0.1", ["*"], "box")
    assert star.origin_allowed("https://anything.example")


def test_host_check_only_on_loopback() -> None:
    loopback = CorsPolicy.build("127.0.0.1", hostname="MyBox")
    assert loopback.host_allowed("mybox:11434") == (True, True)
    assert loopback.host_allowed("") == (True, True)
    assert loopback.host_allowed("172.20.0.1:1") == (True, False)
    assert loopback.host_allowed("172.32.0.1") == (False, False)
    assert loopback.host_allowed("[fd00::1]:80") == (True, False)
    assert loopback.host_allowed("example.com") == (False, False)
    assert CorsPolicy.build("::1", hostname="b").check_host
    assert CorsPolicy.build("localhost", hostname="b").check_host
    for bound in ("0.0.0.0", "192.168.1.5", "::"):
        policy = CorsPolicy.build(bound, hostname="b")
        assert not policy.check_host
        assert policy.host_allowed("evil.com")[0]


def test_split_host() -> None:
    assert split_host("a:1") == "a"
    assert split_host("[::1]:80") == "::1"
    assert split_host("[::1]") == "::1"
    assert split_host("::1") == "::1"
    assert split_host("a") == "a"


def test_bound_to_all_interfaces_skips_the_host_check(registry_file: Path) -> None:
    import asyncio

    from mlxd.api.app import build_app
    from mlxd.daemon.config import Settings
    from mlxd.daemon.server import build_state
    from mlxd.engine.backend import configure_backend

    state = build_state(Settings("0.0.0.0", 0, registry_file, 300.0, 1), configure_backend())

    async def status(bind_host: str, host: str) -> int:
        transport = httpx.ASGITransport(app=build_app(state, bind_host=bind_host))
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
            return (await client.get("/api/version")).status_code

    assert asyncio.run(status("0.0.0.0", "evil.com")) == 200
    assert asyncio.run(status("127.0.0.1", "evil.com")) == 403
    assert asyncio.run(status("127.0.0.1", "localhost")) == 200
