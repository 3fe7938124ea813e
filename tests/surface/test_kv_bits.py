"""`kv_bits` a model cannot take is a clear 400 on every route, whether the request or the
registry entry asks for it; the check reads the caches the model really makes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from mlx_lm.models import gemma3_text, llama

from mlxd.engine.kvquant import KvLayout, kv_layout
from mlxd.engine.options import OptionsError
from tests.conftest import RunningServer, ServerThread
from tests.fixtures.tiny_models import TinyPair

BAD = {"kv_bits": 4, "kv_group_size": 64}  # the tiny model's heads are 16 wide


def test_layout_of_a_plain_model_lists_its_head_width() -> None:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=48, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=32, num_key_value_heads=1,
    )  # fmt: skip
    layout = kv_layout(llama.Model(args))
    assert layout == KvLayout((24,))
    layout.check(8, 8)
    with pytest.raises(OptionsError, match=r"kv_group_size 32 does not divide .*\(24\)"):
        layout.check(8, 32)
    layout.check(None, 32)


def test_sliding_window_caches_refuse_kv_bits() -> None:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, head_dim=32, vocab_size=32, sliding_window=8,
        sliding_window_pattern=2,
    )  # fmt: skip
    layout = kv_layout(gemma3_text.Model(args))
    with pytest.raises(OptionsError, match="sliding-window"):
        layout.check(4, 32)


@pytest.fixture(scope="module")
def kv_server(
    tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    registry: Path = tmp_path_factory.mktemp("kv") / "models.yaml"
    registry.write_text(
        f"models:\n  tiny:\n    target: {tiny_pair.target}\n"
        f"  kvbad:\n    target: {tiny_pair.target}\n    options:\n"
        "      kv_bits: 4\n      kv_group_size: 64\n",
        encoding="utf-8",
    )
    with ServerThread(registry) as info:
        yield info


@pytest.mark.parametrize(("model", "options"), [("tiny", BAD), ("kvbad", {})])
def test_native_routes_answer_400(kv_server: RunningServer, model: str, options: dict) -> None:
    client = ollama.Client(host=kv_server.base_url)
    calls = [
        lambda: client.generate(model, "hi", options=options, stream=False),
        lambda: client.chat(model, [{"role": "user", "content": "hi"}], options=options),
    ]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 400
        assert "does not divide this model's head size (16)" in caught.value.error


def test_v1_routes_answer_400_for_the_registry_entry(kv_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=kv_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="head size"):
        client.chat.completions.create(model="kvbad", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="head size"):
        client.completions.create(model="kvbad", prompt="x")


def test_the_same_model_serves_requests_without_kv_bits(kv_server: RunningServer) -> None:
    r = httpx.post(
        kv_server.base_url + "/api/generate",
        json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
