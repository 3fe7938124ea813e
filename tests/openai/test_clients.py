"""Third-party clients against the real server: litellm, langchain-ollama and ollama-js."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningServer

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]

# litellm builds pydantic models at import that warn about `ReadOnly` TypedDict items
pytestmark = pytest.mark.filterwarnings("ignore:Items? .*ReadOnly:UserWarning")


# -- litellm ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm() -> Any:
    # conftest.py sets LITELLM_LOCAL_MODEL_COST_MAP so the import does not reach the network
    return pytest.importorskip("litellm")


@pytest.mark.parametrize("route", ["ollama_chat", "openai"])
def test_litellm_completion(litellm: Any, server: RunningServer, route: str) -> None:
    kwargs = _litellm_target(server, route)
    out = litellm.completion(messages=MESSAGES, max_tokens=8, temperature=0, **kwargs)
    assert out.choices[0].message.content
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8

    chunks = list(
        litellm.completion(messages=MESSAGES, max_tokens=8, temperature=0, stream=True, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_litellm_openai_stream_usage(litellm: Any, server: RunningServer) -> None:
    chunks = list(
        litellm.completion(
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **_litellm_target(server, "openai"),
        )
    )
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == 6


def _litellm_target(server: RunningServer, route: str) -> dict[str, Any]:
    if route == "openai":
        return {"model": "openai/tiny", "api_base": server.base_url + "/v1", "api_key": "x"}
    return {"model": "ollama_chat/tiny", "api_base": server.base_url}


# -- langchain-ollama ---------------------------------------------------------------------------


def test_langchain_ollama_invoke_and_stream(server: RunningServer) -> None:
    langchain_ollama = pytest.importorskip("langchain_ollama")
    llm = langchain_ollama.ChatOllama(
        model="tiny", base_url=server.base_url, num_predict=8, temperature=0
    )
    message = llm.invoke("Why is the sky blue?")
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["done_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == 8
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Why is the sky blue?"))
    assert streamed == message.content


# -- ollama-js under Node.js --------------------------------------------------------------------

NODE_SCRIPT = r"""
import { Ollama } from 'ollama';

const ollama = new Ollama({ host: process.argv[2] });
const out = {};
out.version = await ollama.version();
out.list = (await ollama.list()).models.map((m) => m.name).sort();
const opts = { num_predict: 8, temperature: 0 };
out.chat = await ollama.chat({ model: 'tiny', messages: [{ role: 'user', content: 'hi' }], options: opts });
const parts = [];
let last = null;
for await (const part of await ollama.chat({
  model: 'tiny', messages: [{ role: 'user', content: 'hi' }], options: opts, stream: true,
})) {
  parts.push(part.message.content);
  last = part;
}
out.stream = { text: parts.join(''), last };
out.generate = await ollama.generate({ model: 'tiny', prompt: 'hello', options: opts });
try {
  await ollama.chat({ model: 'missing', messages: [{ role: 'user', content: 'x' }] });
  out.error = null;
} catch (e) {
  out.error = { message: e.message, status: e.status_code };
}
console.log(JSON.stringify(out));
"""

_NETWORK_ERRORS = (
    "ENOTFOUND",
    "EAI_AGAIN",
    "ECONNREFUSED",
    "ECONNRESET",
    "ETIMEDOUT",
    "ENETUNREACH",
)


@pytest.fixture(scope="session")
def ollama_js(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temp dir with `npm install ollama` done; skipped only when npm cannot reach a registry."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm are not installed")
    root = tmp_path_factory.mktemp("ollama-js")
    (root / "package.json").write_text('{"name": "mlxd-ollama-js-test", "private": true}\n')
    try:
        result = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "ollama"],
            cwd=root, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip("npm install ollama timed out (no network?)")
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if any(code in output for code in _NETWORK_ERRORS):
            pytest.skip(f"npm install ollama failed, no network: {output.strip()[-300:]}")
        pytest.fail(f"npm install ollama failed:\n{output}")
    (root / "client.mjs").write_text(NODE_SCRIPT)
    return root


def test_ollama_js_client(ollama_js: Path, server: RunningServer) -> None:
    result = subprocess.run(
        ["node", "client.mjs", server.base_url],
        cwd=ollama_js, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["version"] == {"version": "0.33.0"}
    assert "tiny:latest" in out["list"]
    chat = out["chat"]
    assert chat["done"] is True and chat["done_reason"] == "length"
    assert chat["eval_count"] == 8 and chat["message"]["role"] == "assistant"
    assert out["stream"]["text"] == chat["message"]["content"]
    assert out["stream"]["last"]["done"] is True
    assert out["generate"]["done_reason"] == "length" and out["generate"]["response"]
    assert out["error"] == {"message": "model 'missing' not found", "status": 404}
