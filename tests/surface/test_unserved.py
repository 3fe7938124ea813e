"""Ollama routes mlxd does not serve answer a JSON error saying so; unknown paths stay 404."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest

from tests.conftest import RunningServer


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def test_push_through_the_ollama_client_says_it_is_not_served(server: RunningServer) -> None:
    client = ollama.Client(host=server.base_url)
    with pytest.raises(ollama.ResponseError) as caught:
        client.push("tiny", stream=False)
    assert caught.value.status_code == 501
    assert "/api/push is not supported by mlxd" in caught.value.error
    assert "hf upload" in caught.value.error


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/status"),
        ("POST", "/api/me"),
        ("POST", "/api/signout"),
        ("DELETE", "/api/user/keys/abc"),
        ("POST", "/api/experimental/web_search"),
    ],
)
def test_native_unserved_routes_answer_ollama_errors(
    http: httpx.Client, method: str, path: str
) -> None:
    r = http.request(method, path, json={})
    assert r.status_code == 501
    body = r.json()
    assert set(body) == {"error"}
    assert body["error"].startswith(f"{path} is not supported by mlxd")


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/audio/transcriptions"])
def test_v1_unserved_routes_answer_openai_errors(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={})
    assert r.status_code == 501
    assert "is not supported by mlxd" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/api/pushx", "/api/nope", "/v1/nope"])
def test_unknown_paths_keep_ollamas_404(http: httpx.Client, path: str) -> None:
    r = http.post(path, json={})
    assert r.status_code == 404
    assert r.text == "404 page not found"
