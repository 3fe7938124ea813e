"""Images are answered alike on /api/generate, /api/chat and /v1: a clear 400 for models
without vision (every model mlxd serves), never silently ignored."""

from __future__ import annotations

import base64

import httpx
import ollama
import openai
import pytest

from tests.conftest import RunningServer

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
REFUSED = "tiny:latest does not support images (it has no vision capability)"


def test_generate_refuses_images(server: RunningServer) -> None:
    client = ollama.Client(host=server.base_url)
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate("tiny", "describe", images=[PNG], stream=False)
    assert caught.value.status_code == 400
    assert caught.value.error == REFUSED


def test_chat_refuses_images_the_same_way(server: RunningServer) -> None:
    client = ollama.Client(host=server.base_url)
    message = {"role": "user", "content": "describe", "images": [PNG]}
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat("tiny", [message], stream=False)
    assert caught.value.status_code == 400
    assert caught.value.error == REFUSED


def test_v1_chat_refuses_image_parts(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    part = [{"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": part}],  # type: ignore[list-item,misc]
        )
    assert REFUSED in str(caught.value)


@pytest.mark.parametrize("route", ["/api/generate", "/api/chat"])
def test_data_that_is_not_base64_is_named(server: RunningServer, route: str) -> None:
    body: dict[str, object] = {"model": "tiny", "stream": False}
    if route == "/api/generate":
        body.update(prompt="hi", images=["not base64!"])
    else:
        body["messages"] = [{"role": "user", "content": "hi", "images": ["not base64!"]}]
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"].startswith("invalid image data")


def test_empty_images_list_is_no_image(server: RunningServer) -> None:
    r = httpx.post(
        server.base_url + "/api/generate",
        json={"model": "tiny", "prompt": "hi", "images": [], "stream": False,
              "options": {"num_predict": 2}},
        timeout=120,
    )  # fmt: skip
    assert r.status_code == 200, r.text
