"""The prefix cache, end to end through the real server and unit by unit on its tiers.

Server tests run their own daemons (like tests/conftest.py's ServerThread, but with the cache
settings of `daemon.config.Settings`) on a private cache directory, so every namespace starts
cold and no other test's requests can warm it. Prompts are raw, long enough for several
64-token blocks, and decoded greedily so a warm answer must equal the cold one.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import httpx
import mlx.core as mx
import numpy as np
import pytest

from mlxd.engine import prefix_cache as pc
from mlxd.engine.prefix_cache import (
    Block,
    Namespace,
    PrefixCache,
    RamTier,
    SsdTier,
    block_keys,
    decode,
    encode,
)
from tests.cache.blocks import BLOCK, KILL_NS, chain, kill_block, kill_keys, kill_tokens, make_block
from tests.conftest import ServerThread
from tests.fixtures.tiny_models import TARGET_SHAPE, TinyPair, write_model

ROOT = Path(__file__).resolve().parents[2]
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 16}
MiB = 2**20

# -- servers with cache settings --------------------------------------------------------------


class CacheServer(ServerThread):
    """The test server with its own prefix-cache directory and budgets."""

    def __init__(
        self,
        registry: Path,
        cache_dir: Path,
        ram_bytes: int = 256 * MiB,
        ssd_bytes: int = 256 * MiB,
    ) -> None:
        super().__init__(
            registry, max_loaded=4,
            cache_ram_bytes=ram_bytes, cache_ssd_bytes=ssd_bytes, cache_dir=cache_dir,
        )  # fmt: skip
        self.base_url = self.info.base_url

    @property
    def prefix(self) -> PrefixCache:
        cache = self.state.manager.prefix
        assert cache is not None
        return cache

    def __enter__(self) -> CacheServer:  # type: ignore[override]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        assert not self.thread.is_alive(), "server did not shut down"


@dataclass(frozen=True)
class Models:
    registry: Path  # tiny, pair, kv, other
    small_registry: Path  # tiny only: quick to start, for restart tests
    target: Path  # the tiny target's directory


@pytest.fixture(scope="module")
def models(tiny_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("cache-models")
    # head_dim 32 (the tiny target's 16 is below the smallest KV quantization group).
    kv = write_model(
        root / "kv", tiny_pair.tokenizer_dir, seed=3, hidden_size=64, num_layers=2,
        num_heads=2, num_kv_heads=2, intermediate_size=128,
    )  # fmt: skip
    other = write_model(root / "other", tiny_pair.tokenizer_dir, seed=11, **TARGET_SHAPE)
    registry = root / "models.yaml"
    registry.write_text(
        "models:\n"
        f"  tiny:\n    target: {tiny_pair.target}\n"
        f"  pair:\n    target: {tiny_pair.target}\n    draft: {tiny_pair.draft}\n"
        f"  kv:\n    target: {kv}\n"
        f"  other:\n    target: {other}\n",
        encoding="utf-8",
    )
    small = root / "small.yaml"
    small.write_text(f"models:\n  tiny:\n    target: {tiny_pair.target}\n", encoding="utf-8")
    return Models(registry, small, tiny_pair.target)


@pytest.fixture(scope="module")
def shared(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    """One daemon with its own cache for the tests that only need distinct prompts."""
    with CacheServer(models.registry, tmp_path_factory.mktemp("kvcache")) as srv:
        yield srv


_TEXT = (
    "the quick brown fox jumps over lazy dog small model can still say hello world answer "
    "question tell short story about weather once upon time there was daemon that served "
    "language models streamed tokens cached prompts and let draft guess ahead why sky blue"
)
_WORDS = tuple(re.findall(r"[a-z]+", _TEXT))


def prompt_text(tag: str, words: int = 70) -> str:
    """A deterministic raw prompt of roughly 4 tokens per word, unique to `tag`."""
    rng = random.Random(tag)
    return f"[{tag}] " + " ".join(rng.choice(_WORDS) for _ in range(words))


def generate(base_url: str, model: str, prompt: str, **options: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "raw": True,
        "stream": False,
        "options": {**GREEDY, **options},
    }
    r = httpx.post(f"{base_url}/api/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["done"] is True
    return out


def chat(base_url: str, model: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": model, "messages": messages, "stream": False, "options": GREEDY}
    r = httpx.post(f"{base_url}/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def full_blocks_before_last(prompt_tokens: int) -> int:
    """What a warm request restores from SSD: every full block of the prompt but its last
    token (the partial block after them is kept in RAM only)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def all_but_last(prompt_tokens: int) -> int:
    """What a repeated prompt restores from RAM: everything but its last token, which has to
    run to give the next token's logits."""
    return prompt_tokens - 1


# -- 1. a repeated prompt hits -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "method"),
    [("tiny", "off"), ("pair", "off"), ("pair", "model"), ("pair", "lookup"), ("pair", "auto")],
)
def test_repeated_prompt_hits(shared: CacheServer, model: str, method: str) -> None:
    prompt = prompt_text(f"repeat-{model}-{method}")
    cold = generate(shared.base_url, model, prompt, draft_method=method)
    warm = generate(shared.base_url, model, prompt, draft_method=method)
    n = cold["prompt_eval_count"]
    assert n >= 200
    assert cold["prompt_cache_tokens"] == 0
    assert warm["prompt_eval_count"] == n  # the whole prompt still counts
    assert warm["prompt_cache_tokens"] == all_but_last(n)
    assert warm["response"] == cold["response"]
    assert cold["eval_count"] == warm["eval_count"] == GREEDY["num_predict"]


def test_grammar_requests_share_the_prefix_cache(shared: CacheServer) -> None:
    """A grammar does not change K/V: constrained and free requests hit each other's entries."""
    prompt = prompt_text("grammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}}
    body = {"model": "pair", "prompt": prompt, "raw": True, "stream": False, "format": schema,
            "options": {"temperature": 0, "num_predict": 40}}  # fmt: skip
    cold = httpx.post(f"{shared.base_url}/api/generate", json=body, timeout=120).json()
    warm = httpx.post(f"{shared.base_url}/api/generate", json=body, timeout=120).json()
    n = cold["prompt_eval_count"]
    assert cold["prompt_cache_tokens"] == 0 and warm["prompt_cache_tokens"] == all_but_last(n)
    assert warm["response"] == cold["response"] and cold["done_reason"] == "stop"
    assert json.loads(warm["response"]).keys() <= {"n"}
    free = generate(shared.base_url, "pair", prompt)
    assert free["prompt_cache_tokens"] == all_but_last(n)


def test_longer_prompt_reuses_the_shared_prefix(shared: CacheServer) -> None:
    """A prompt that extends a cached one restores the common blocks and no more."""
    base = prompt_text("extend", words=60)
    first = generate(shared.base_url, "tiny", base, draft_method="off")
    longer = generate(
        shared.base_url, "tiny", base + " " + prompt_text("tail", 30), draft_method="off"
    )
    assert first["prompt_cache_tokens"] == 0
    assert longer["prompt_cache_tokens"] >= full_blocks_before_last(first["prompt_eval_count"])
    assert longer["prompt_cache_tokens"] < longer["prompt_eval_count"]


# -- 2. the next turn of a chat hits -----------------------------------------------------------


def test_next_chat_turn_hits(shared: CacheServer) -> None:
    system = "You are a careful assistant. " + prompt_text("chat-system", 60)
    turn1 = [
        {"role": "system", "content": system},
        {"role": "user", "content": prompt_text("chat-user-1", 12)},
    ]
    first = chat(shared.base_url, "tiny", turn1)
    assert first["prompt_cache_tokens"] == 0
    n1 = first["prompt_eval_count"]
    assert n1 >= 200
    reply = first["message"]["content"]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": prompt_text("chat-user-2", 12)},
    ]
    second = chat(shared.base_url, "tiny", turn2)
    hit = second["prompt_cache_tokens"]
    assert second["prompt_eval_count"] > n1
    assert hit > 0
    # At least every full block of turn 1's prompt (its final "\n" may re-tokenize with the
    # reply that follows it, so allow one block less).
    assert hit >= full_blocks_before_last(n1) - BLOCK


# -- 3. namespaces never share -----------------------------------------------------------------


def test_draft_methods_share_the_targets_blocks(shared: CacheServer) -> None:
    """Target blocks are keyed by the target alone: a prompt cached with speculation off is
    hit by every draft method (a draft model re-reads what has no attachment yet), and the
    text stays the same."""
    prompt = prompt_text("ns-draft")
    firsts = {
        method: generate(shared.base_url, "pair", prompt, draft_method=method)
        for method in ("off", "lookup", "model", "auto")
    }
    assert firsts["off"]["prompt_cache_tokens"] == 0
    for method in ("lookup", "model", "auto"):
        n = firsts[method]["prompt_eval_count"]
        assert firsts[method]["prompt_cache_tokens"] == all_but_last(n), method
        assert firsts[method]["response"] == firsts["off"]["response"], method


def test_kv_quantization_does_not_share(shared: CacheServer) -> None:
    prompt = prompt_text("ns-kv")
    variants: list[dict[str, Any]] = [
        {},
        {"kv_bits": 8, "kv_group_size": 32},
        {"kv_bits": 4, "kv_group_size": 32},
        {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 128},
    ]
    for opts in variants:
        out = generate(shared.base_url, "kv", prompt, draft_method="off", **opts)
        assert out["prompt_cache_tokens"] == 0, opts
    for opts in variants:
        out = generate(shared.base_url, "kv", prompt, draft_method="off", **opts)
        assert out["prompt_cache_tokens"] > 0, opts


def test_models_do_not_share(shared: CacheServer) -> None:
    prompt = prompt_text("ns-model")
    tiny = generate(shared.base_url, "tiny", prompt, draft_method="off")
    other = generate(shared.base_url, "other", prompt, draft_method="off")
    assert tiny["prompt_cache_tokens"] == 0
    assert other["prompt_cache_tokens"] == 0
    assert other["response"] != tiny["response"]  # really a different model
    # The same target files under another registry name are the same K/V: they do share.
    pair = generate(shared.base_url, "pair", prompt, draft_method="off")
    assert pair["prompt_cache_tokens"] > 0
    assert pair["response"] == tiny["response"]


# -- 4. warm equals cold with a quantized KV cache --------------------------------------------


@pytest.mark.parametrize("method", ["off", "lookup"])
def test_warm_equals_cold_with_kv_bits_8(shared: CacheServer, method: str) -> None:
    prompt = prompt_text(f"kv8-{method}")
    opts = {"kv_bits": 8, "kv_group_size": 32, "draft_method": method}
    cold = generate(shared.base_url, "kv", prompt, **opts)
    warm = generate(shared.base_url, "kv", prompt, **opts)
    assert cold["prompt_cache_tokens"] == 0
    assert warm["prompt_cache_tokens"] == all_but_last(cold["prompt_eval_count"])
    assert warm["response"] == cold["response"]


@pytest.mark.parametrize("model", ["tiny", "pair"])
def test_a_keystroke_mid_prompt_restores_up_to_it_and_answers_as_cold(
    shared: CacheServer, models: Models, tmp_path: Path, model: str
) -> None:
    """An editor re-sends its prompt with a few characters typed in the middle: everything
    before them is restored (not only the blocks before them), and the answer is the one a
    daemon with nothing cached gives."""
    text = prompt_text(f"keystroke-{model}", words=80)
    generate(shared.base_url, model, text)
    cut = len(text) // 2
    edited = text[:cut] + "xyz" + text[cut:]
    warm = generate(shared.base_url, model, edited)
    block = shared.prefix.block
    assert warm["prompt_cache_tokens"] % block != 0  # into the block the edit lands in
    with CacheServer(models.registry, tmp_path / "fresh") as cold:
        reference = generate(cold.base_url, model, edited)
    assert reference["prompt_cache_tokens"] == 0
    assert warm["response"] == reference["response"]
    assert warm["prompt_eval_count"] == reference["prompt_eval_count"]


def _hit_tokens(base: str) -> int:
    return int(httpx.get(f"{base}/api/mlxd/stats").json()["prefix_cache"]["hit_tokens"])


def test_a_quantized_kv_row_takes_only_a_hit_of_its_whole_head(
    shared: CacheServer, models: Models, tmp_path: Path
) -> None:
    """A cold prompt is read at full precision and then quantized: the rest of a longer prompt
    read against a quantized prefix would differ, so a quantizing row recomputes it (and what
    it decoded against quantized K/V is not offered); an exact repeat still hits."""
    opts = {"kv_bits": 4, "kv_group_size": 32, "draft_method": "off"}
    base = prompt_text("kv4-extend", words=60)
    first = generate(shared.base_url, "kv", base, **opts)
    longer = base + " " + prompt_text("kv4-tail", 30)
    hits = _hit_tokens(shared.base_url)
    extended = generate(shared.base_url, "kv", longer, **opts)
    assert _hit_tokens(shared.base_url) == hits  # the refused hit is no hit in the counts
    again = generate(shared.base_url, "kv", longer, **opts)
    assert extended["prompt_cache_tokens"] == 0 < again["prompt_cache_tokens"]
    assert _hit_tokens(shared.base_url) == hits + again["prompt_cache_tokens"]
    assert again["response"] == extended["response"]
    with CacheServer(models.registry, tmp_path / "fresh") as cold:  # nothing cached there
        reference = generate(cold.base_url, "kv", longer, **opts)
    assert reference["prompt_cache_tokens"] == 0
    assert extended["response"] == reference["response"]
    follow = generate(shared.base_url, "kv", base + first["response"], **opts)
    assert follow["prompt_cache_tokens"] == 0  # the next turn: a part of its head, recomputed


# -- 5. a restarted daemon serves from SSD -----------------------------------------------------


def test_restart_serves_from_ssd(models: Models, tmp_path: Path) -> None:
    cache_dir = tmp_path / "kvcache"
    prompt = prompt_text("restart", 90)
    with CacheServer(models.small_registry, cache_dir) as a:
        cold = generate(a.base_url, "tiny", prompt, draft_method="off")
        assert cold["prompt_cache_tokens"] == 0
    # A's shutdown persisted its RAM blocks; B starts with an empty RAM tier.
    with CacheServer(models.small_registry, cache_dir) as b:
        assert b.prefix.snapshot()["ram_blocks"] == 0
        warm = generate(b.base_url, "tiny", prompt, draft_method="off")
        snap = b.prefix.snapshot()
    assert warm["prompt_cache_tokens"] == full_blocks_before_last(cold["prompt_eval_count"])
    assert snap["ssd_hit_blocks"] == warm["prompt_cache_tokens"] // BLOCK
    assert snap["ram_hit_blocks"] == 0
    assert warm["response"] == cold["response"]


# -- 6. corrupted SSD entries are misses -------------------------------------------------------


def _stored_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.val"))


def _corrupt_database_values(cache_dir: Path) -> int:
    """Flip a byte in every value diskcache keeps inline in its database (< 32 KiB)."""
    con = sqlite3.connect(cache_dir / "cache.db")
    try:
        rows = con.execute("SELECT rowid, value FROM Cache WHERE value IS NOT NULL").fetchall()
        for rowid, value in rows:
            data = bytearray(value)
            data[len(data) // 2] ^= 0xFF
            con.execute("UPDATE Cache SET value = ? WHERE rowid = ?", (bytes(data), rowid))
        con.commit()
    finally:
        con.close()
    return len(rows)


def test_corrupted_ssd_after_restart_is_a_miss(models: Models, tmp_path: Path) -> None:
    cache_dir = tmp_path / "kvcache"
    prompt = prompt_text("corrupt", 90)
    with CacheServer(models.small_registry, cache_dir) as a:
        cold = generate(a.base_url, "tiny", prompt, draft_method="off")
    files = _stored_files(cache_dir)
    assert len(files) >= 3  # the tiny target's blocks are ~32 KiB: stored as files
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 3 == 2:
            path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
        else:
            mid = len(data) // 2
            data[mid : mid + 16] = bytes(16)  # zeroed in the middle
            data[mid + 100] ^= 0x5A
            path.write_bytes(bytes(data))
    inline = _corrupt_database_values(cache_dir)
    with diskcache.Cache(str(cache_dir)) as dc:
        assert len(files) + inline == len(dc)  # every stored value was damaged
    with CacheServer(models.small_registry, cache_dir) as b:
        warm = generate(b.base_url, "tiny", prompt, draft_method="off")
        snap = b.prefix.snapshot()
        again = generate(b.base_url, "tiny", prompt, draft_method="off")
    assert warm["prompt_cache_tokens"] == 0
    assert snap["ssd_hit_blocks"] == 0
    assert warm["response"] == cold["response"]
    # The recomputed blocks replaced the bad entries.
    assert again["prompt_cache_tokens"] == all_but_last(cold["prompt_eval_count"])
    assert again["response"] == cold["response"]


def test_partly_corrupted_ssd_restores_the_good_prefix(models: Models, tmp_path: Path) -> None:
    """Only the third block is damaged: a restart restores blocks 1-2 and recomputes the rest."""
    cache_dir = tmp_path / "kvcache"
    prompt = prompt_text("corrupt-third", 90)
    with CacheServer(models.small_registry, cache_dir) as a:
        cold = generate(a.base_url, "tiny", prompt, draft_method="off")
    keys = _prompt_keys(models.target, prompt)
    assert len(keys) == full_blocks_before_last(cold["prompt_eval_count"]) // BLOCK >= 4
    with diskcache.Cache(str(cache_dir)) as dc:
        handle = dc.get(keys[2], read=True)
        assert handle is not None
        path = Path(handle.name)
        handle.close()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with CacheServer(models.small_registry, cache_dir) as b:
        warm = generate(b.base_url, "tiny", prompt, draft_method="off")
    assert warm["prompt_cache_tokens"] == 2 * BLOCK
    assert warm["response"] == cold["response"]


def test_corrupted_cache_database_does_not_stop_the_daemon(models: Models, tmp_path: Path) -> None:
    cache_dir = tmp_path / "kvcache"
    prompt = prompt_text("corrupt-db", 90)
    with CacheServer(models.small_registry, cache_dir) as a:
        cold = generate(a.base_url, "tiny", prompt, draft_method="off")
    (cache_dir / "cache.db").write_bytes(b"\x00not a database\x00" * 2048)
    with CacheServer(models.small_registry, cache_dir) as b:
        warm = generate(b.base_url, "tiny", prompt, draft_method="off")
    assert warm["prompt_cache_tokens"] == 0
    assert warm["response"] == cold["response"]


def _prompt_keys(target: Path, prompt: str) -> list[str]:
    """The block keys a raw `prompt` to `target` with speculation off is cached under."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.registry.store import model_digest

    tokens = list(load_tokenizer(target).encode(prompt))  # what raw mode sends to the engine
    ns = Namespace(model=model_digest(target))
    return block_keys(tokens[:-1], ns, BLOCK)


# -- encode / decode ---------------------------------------------------------------------------


def mixed_block(seed: int) -> Block:
    """float32, float16, bfloat16 and a quantized layer in one block."""
    rng = np.random.default_rng(seed)

    def normal(dtype: mx.Dtype) -> mx.array:
        return mx.array(rng.standard_normal((1, 2, BLOCK, 32)).astype(np.float32)).astype(dtype)

    wq_k, s_k, b_k = mx.quantize(normal(mx.float16), group_size=32, bits=8)
    wq_v, s_v, b_v = mx.quantize(normal(mx.float16), group_size=32, bits=8)
    return Block(
        ["kv", "kv", "kv", "q8/32"],
        [
            [normal(mx.float32), normal(mx.float32)],
            [normal(mx.float16), normal(mx.float16)],
            [normal(mx.bfloat16), normal(mx.bfloat16)],
            [wq_k, s_k, b_k, wq_v, s_v, b_v],
        ],
    )


def assert_same_block(got: Block | None, want: Block) -> None:
    assert got is not None
    assert got.kinds == want.kinds
    assert len(got.arrays) == len(want.arrays)
    for got_layer, want_layer in zip(got.arrays, want.arrays, strict=True):
        assert len(got_layer) == len(want_layer)
        for g, w in zip(got_layer, want_layer, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert mx.array_equal(g, w).item()


KEY = "ab" * 32


def test_encode_decode_round_trip() -> None:
    for block in (make_block(1), mixed_block(2)):
        assert_same_block(decode(KEY, encode(KEY, block)), block)


def test_every_flipped_byte_is_a_miss() -> None:
    data = encode(KEY, make_block(3, layers=1, tokens=8, head_dim=4))
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        assert decode(KEY, bytes(bad)) is None, pos


def test_truncated_or_extended_is_a_miss() -> None:
    data = encode(KEY, make_block(4))
    for cut in (0, 1, 7, 8, 12, 20, 40, len(data) // 2, len(data) - 4, len(data) - 1):
        assert decode(KEY, data[:cut]) is None, cut
    assert decode(KEY, data + b"\x00") is None


def test_wrong_key_is_a_miss() -> None:
    data = encode(KEY, make_block(5))
    assert decode("cd" * 32, data) is None
    assert decode("", data) is None


def test_other_version_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    block = make_block(6)
    monkeypatch.setattr(pc, "FORMAT_VERSION", pc.FORMAT_VERSION + 1)
    newer = encode(KEY, block)  # a valid checksum over a header that says a later version
    monkeypatch.undo()
    assert decode(KEY, newer) is None
    other_magic = b"MLXDKV\x00\x01" + encode(KEY, block)[len(pc.MAGIC) :]
    assert decode(KEY, other_magic) is None


def test_garbage_is_a_miss() -> None:
    rng = random.Random(7)
    samples = [b"", b"\x00" * 100, pc.MAGIC, pc.MAGIC + b"\xff" * 64]
    samples += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 4096))) for _ in range(50)]
    samples += [pc.MAGIC + bytes(rng.getrandbits(8) for _ in range(200)) for _ in range(50)]
    for data in samples:
        assert decode(KEY, data) is None


def _envelope(header: bytes, body: bytes = b"") -> bytes:
    """A well-formed entry (right magic, lengths and checksum) around any header."""
    import struct

    from crc32c import crc32c

    crc = crc32c(header + body)
    return pc.MAGIC + struct.pack("<IQI", len(header), len(body), crc) + header + body


def test_checksummed_entry_with_a_bad_header_is_a_miss() -> None:
    bad_headers = [
        b"not json",
        b'{"v": 1}',  # no key, kinds or arrays
        b'{"v": 1, "key": "%s", "kinds": ["kv"], "arrays": [[["int8", [4]]]]}' % KEY.encode(),
        b'{"v": 1, "key": "%s", "kinds": ["kv"], "arrays": [[["float32", [999]]]]}' % KEY.encode(),
    ]
    for header in bad_headers:
        assert decode(KEY, _envelope(header, b"\x00" * 16)) is None, header


@pytest.mark.parametrize("header", [b"[]", b"1", b'"v"', b"null"])
def test_checksummed_non_object_header_is_a_miss(header: bytes) -> None:
    assert decode(KEY, _envelope(header)) is None


# -- SsdTier -----------------------------------------------------------------------------------


def test_ssd_tier_round_trip_and_bad_values(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path / "ssd", 64 * MiB)
    try:
        blocks = {f"{i:064x}": make_block(i) for i in range(4)}
        small = make_block(99, layers=1, tokens=4)  # < 32 KiB: stored inside the database
        blocks["small".ljust(64, "0")] = small
        for key, block in blocks.items():
            tier.put_async(key, block)
        tier.flush()
        for key, block in blocks.items():
            assert_same_block(tier.get(key), block)
        assert tier.get("f" * 64) is None  # never stored

        keys = list(blocks)
        stored = bytes(tier.cache[keys[0]])
        flipped = bytearray(stored)
        flipped[len(flipped) // 2] ^= 0x80
        tier.cache.set(keys[0], bytes(flipped))
        tier.cache.set(keys[1], stored[: len(stored) - 100])
        tier.cache.set(keys[2], stored)  # key 0's entry under key 2: a foreign entry
        with pytest.raises(TypeError):
            tier.cache.set(keys[3], "not bytes")  # the tier's store takes bytes only
        # Rows of other kinds, written behind the store's back: text, an int.
        con = sqlite3.connect(tmp_path / "ssd" / "cache.db")
        with con:
            con.execute("UPDATE Cache SET mode = 3, value = NULL, filename = 'x.txt'"
                        " WHERE key = ?", (keys[3],))  # fmt: skip
            con.execute("UPDATE Cache SET mode = 1, value = 12345, filename = NULL"
                        " WHERE key = ?", (keys[4],))  # fmt: skip
        con.close()
        for key in keys:
            assert tier.get(key) is None, key
        # A bad entry is deleted on read, so it is rewritten by the next put.
        assert keys[0] not in tier.cache
        tier.put_async(keys[0], blocks[keys[0]])
        tier.flush()
        assert_same_block(tier.get(keys[0]), blocks[keys[0]])
    finally:
        tier.close()


def test_value_files_corrupted_on_disk_are_misses(tmp_path: Path) -> None:
    tier = SsdTier(tmp_path / "ssd", 64 * MiB)
    keys = [f"{i:064x}" for i in range(6)]
    for i, key in enumerate(keys):
        tier.put_async(key, make_block(i))
    tier.close()
    files = _stored_files(tmp_path / "ssd")
    assert len(files) == len(keys)
    files[0].write_bytes(b"")
    files[1].write_bytes(files[1].read_bytes()[:100])
    data = bytearray(files[2].read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xee" * 64
    files[2].write_bytes(bytes(data))
    files[3].unlink()
    tier = SsdTier(tmp_path / "ssd", 64 * MiB)
    try:
        results = {key: tier.get(key) for key in keys}
        bad = [k for k, b in results.items() if b is None]
        assert len(bad) == 4
        for i, key in enumerate(keys):
            if results[key] is not None:
                assert_same_block(results[key], make_block(i))
    finally:
        tier.close()


# -- 7. budgets hold under pressure ------------------------------------------------------------


def test_ram_tier_stays_within_budget_and_evicts_lru_first() -> None:
    sizes = [BLOCK // 4 * (1 + i % 4) for i in range(40)]  # varied block sizes
    blocks = {f"k{i}": make_block(i, layers=1, tokens=t, head_dim=8) for i, t in enumerate(sizes)}
    budget = 6 * blocks["k3"].nbytes
    ram = RamTier(budget)
    order: list[str] = []  # our own model of recency, least recent first
    rng = random.Random(3)
    for key, block in blocks.items():
        if order and rng.random() < 0.5:  # touch one: it becomes most recent
            touched = rng.choice(order)
            assert ram.get(touched) is not None
            order.remove(touched)
            order.append(touched)
        evicted = ram.put(key, block)
        order.append(key)
        expected = []
        total = sum(blocks[k].nbytes for k in order)
        while total > budget:
            old = order.pop(0)
            expected.append(old)
            total -= blocks[old].nbytes
        assert [k for k, _ in evicted] == expected
        assert list(ram.entries) == order
        assert ram.nbytes == sum(b.nbytes for b in ram.entries.values()) <= budget


def test_ram_tier_rejects_a_block_larger_than_its_budget() -> None:
    block = make_block(1)
    ram = RamTier(block.nbytes - 1)
    assert ram.put("big", block) == [("big", block)]
    assert ram.nbytes == 0 and not ram.entries
    assert ram.get("big") is None


def test_small_ram_spills_to_ssd_and_lookup_finds_it(tmp_path: Path) -> None:
    ns = Namespace(model="spill")
    tokens = chain(12)
    keys = block_keys(tokens, ns, BLOCK)
    blocks = [make_block(100 + i) for i in range(len(keys))]
    budget = 3 * blocks[0].nbytes
    cache = PrefixCache(budget, tmp_path / "ssd", 64 * MiB)
    try:
        for key, block in zip(keys, blocks, strict=True):
            cache.insert(key, block)
            assert cache.ram.nbytes <= budget
        cache.ssd.flush() if cache.ssd is not None else None
        found = cache.lookup(ns, tokens)
        assert len(found) == len(keys)
        for got, want in zip(found, blocks, strict=True):
            assert_same_block(got, want)
        snap = cache.snapshot()
        assert snap["ssd_hit_blocks"] >= len(keys) - 3
        assert snap["ram_bytes"] <= budget
    finally:
        cache.close()


def test_draft_attachments_count_as_restored_bytes_per_tier(tmp_path: Path) -> None:
    """A draft's state restored beside the target's blocks counts in the tier it came from,
    as the blocks do: from RAM while it is there, from SSD after a restart."""
    ns = Namespace(model="attached")
    tokens = chain(2)
    keys = block_keys(tokens, ns, BLOCK)
    blocks = [make_block(10 + i) for i in range(len(keys))]
    extras = [make_block(20 + i) for i in range(len(keys))]
    target = sum(b.nbytes for b in blocks)
    draft = sum(b.nbytes for b in extras)
    cache = PrefixCache(64 * MiB, tmp_path / "ssd", 64 * MiB)
    try:
        for key, block, extra in zip(keys, blocks, extras, strict=True):
            cache.insert(key, block)
            cache.attach(key, "draft-rev", extra)
        found = cache.lookup_keyed(ns, tokens)
        assert len(cache.attachments([k for k, _ in found], "draft-rev")) == len(keys)
        assert cache.snapshot()["restored_bytes"] == draft  # the blocks: once restored
        cache.used(found)
        snap = cache.snapshot()
        assert (cache.stats.ram_hit_bytes, cache.stats.ssd_hit_bytes) == (target + draft, 0)
        assert snap["restored_bytes"] == target + draft
    finally:
        cache.close()
    reopened = PrefixCache(64 * MiB, tmp_path / "ssd", 64 * MiB)
    try:
        found = reopened.lookup_keyed(ns, tokens)
        assert len(reopened.attachments([k for k, _ in found], "draft-rev")) == len(keys)
        reopened.used(found)
        assert reopened.stats.ssd_hit_bytes == target + draft
        assert reopened.stats.ram_hit_bytes == 0
    finally:
        reopened.close()


def _offer_tail(cache: PrefixCache, ns: Namespace, tokens: list[int], seed: int) -> Block:
    """Cache the full blocks of `tokens` and the partial block after them."""
    full = len(tokens) // BLOCK
    for i, key in enumerate(block_keys(tokens, ns, BLOCK)):
        cache.insert(key, make_block(seed + i))
    tail = cache.tail(ns, tokens)
    assert tail is not None
    block = make_block(seed + 99, tokens=len(tokens) - full * BLOCK)
    cache.insert_tail(tail[0], tokens[full * BLOCK :], tail[1], block)
    return block


def test_partial_blocks_restore_up_to_where_prompts_diverge(tmp_path: Path) -> None:
    """A cached prompt's partial last block serves a repeat and any prompt that continues it;
    one that diverges inside it (or stops short of its end) gets its shared first tokens.
    Partial blocks never go to SSD."""
    ns = Namespace(model="tails")
    tokens = chain(3)[: 2 * BLOCK + 20]
    cache = PrefixCache(64 * MiB, tmp_path / "ssd", 64 * MiB)
    try:
        tail = _offer_tail(cache, ns, tokens, seed=300)
        assert cache.tail(ns, tokens) is None  # cached already
        assert cache.tail(ns, tokens[: 2 * BLOCK]) is None  # ends on a block boundary
        repeat = cache.lookup(ns, tokens)
        assert [b.tokens for b in repeat] == [BLOCK, BLOCK, 20]
        assert_same_block(repeat[-1], tail)
        longer = cache.lookup(ns, [*tokens, 7, 8, 9])
        assert sum(b.tokens for b in longer) == 2 * BLOCK + 20
        diverged = cache.lookup(ns, [*tokens[:-1], tokens[-1] + 1])
        assert sum(b.tokens for b in diverged) == 2 * BLOCK + 19
        assert_same_rows(diverged[-1], tail, 19)
        assert cache.lookup(ns, tokens[: 2 * BLOCK + 18])[-1].tokens == 18  # a shorter one
        assert cache.lookup(ns, tokens[: 2 * BLOCK + 5])[-1].tokens == BLOCK  # too few shared
        assert cache.lookup(Namespace(model="other"), tokens) == []
        cache.persist()
        reopened = PrefixCache(64 * MiB, tmp_path / "ssd", 64 * MiB)
        try:
            assert sum(b.tokens for b in reopened.lookup(ns, tokens)) == 2 * BLOCK
        finally:
            reopened.close()
    finally:
        cache.close()


def assert_same_rows(part: Block, whole: Block, rows: int) -> None:
    """`part` holds `whole`'s first `rows` token positions, every layer."""
    assert part.tokens == rows
    for mine, theirs in zip(part.arrays, whole.arrays, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert mx.array_equal(a, b[..., :rows, :])


def test_a_prompt_diverging_inside_a_full_block_restores_its_shared_rows() -> None:
    """A keystroke in the middle of an editor's prompt, another question after a shared
    system prompt: the block the prompt diverges in gives its first rows (K/V at a position
    depend only on the tokens before it), with no draft attachment; evicted, it gives none
    and leaves the index."""
    ns = Namespace(model="shared-rows")
    tokens = chain(3, seed=4)
    keys = block_keys(tokens, ns, BLOCK)
    blocks = [make_block(900 + i) for i in range(3)]
    cache = PrefixCache(256 * MiB)
    for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        parent = keys[i - 1] if i else ns.seed.hex()
        cache.insert(key, block, under=(parent, tokens[i * BLOCK : (i + 1) * BLOCK]))
        cache.attach(key, "draft-rev", make_block(950 + i))
    typed = [*tokens[: BLOCK + 30], 1, 2, 3, *tokens[BLOCK + 30 :]]
    found = cache.lookup_keyed(ns, typed)
    assert [b.tokens for _, b in found] == [BLOCK, 30]
    assert_same_rows(found[-1][1], blocks[1], 30)
    assert len(cache.attachments([k for k, _ in found], "draft-rev")) == 1  # the full one only
    shorter = cache.lookup(ns, tokens[: 2 * BLOCK + 20])  # a prompt cut inside the third
    assert [b.tokens for b in shorter] == [BLOCK, BLOCK, 20]
    assert cache.lookup(ns, [tokens[0] + 1, *tokens[1:]]) == []  # nothing shared
    small = PrefixCache(2 * blocks[0].nbytes)
    small.insert(keys[0], blocks[0], under=(ns.seed.hex(), tokens[:BLOCK]))
    for i, key in enumerate(block_keys(chain(2, seed=5), ns, BLOCK)):  # push it out
        small.insert(key, make_block(990 + i))
    assert small.lookup(ns, [*tokens[:40], 1]) == []
    assert not small._children and not small._child_of


def test_a_lookup_counts_per_tier_only_what_its_caller_restores() -> None:
    """A hit a row refuses (a quantizing row's partial head) moved the blocks and bytes
    counted per tier though nothing was restored; they count with `hit_tokens`, at `used`."""
    ns = Namespace(model="counted")
    tokens = chain(2, seed=6)
    keys = block_keys(tokens, ns, BLOCK)
    cache = PrefixCache(256 * MiB)
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else ns.seed.hex()
        cache.insert(key, make_block(600 + i), under=(parent, tokens[i * BLOCK : (i + 1) * BLOCK]))
    found = cache.lookup_keyed(ns, [*tokens[: BLOCK + 20], 7])  # a block and a partial one
    assert [b.tokens for _, b in found] == [BLOCK, 20]
    s = cache.stats
    assert (s.ram_hit_blocks, s.ram_hit_bytes, s.hit_tokens) == (0, 0, 0)  # refused: no hit
    cache.used(found)
    assert (s.ram_hit_blocks, s.hit_tokens) == (1, BLOCK + 20)
    assert s.ram_hit_bytes == s.restored_bytes == sum(b.nbytes for _, b in found)


def test_partial_blocks_are_bounded_per_parent_and_leave_with_ram() -> None:
    """Past the bound the least recently used partial block under a parent goes: a lookup
    that restores one makes it the most recent."""
    ns = Namespace(model="tails-bound")
    base = chain(1)
    cache = PrefixCache(256 * MiB)
    first, second = [*base, 1, 2, 3], [*base, 2, 2, 3]
    _offer_tail(cache, ns, first, seed=500)
    _offer_tail(cache, ns, second, seed=550)
    for i in range(pc.TAILS_PER_PARENT - 2):
        _offer_tail(cache, ns, [*base, 10 + i, 2, 3], seed=600 + 100 * i)
    assert sum(b.tokens for b in cache.lookup(ns, first)) == BLOCK + 3  # all still held
    _offer_tail(cache, ns, [*base, 9, 2, 3], seed=400)
    assert sum(b.tokens for b in cache.lookup(ns, first)) == BLOCK + 3  # used: kept
    assert sum(b.tokens for b in cache.lookup(ns, second)) == BLOCK  # the least recent went
    small = PrefixCache(2 * make_block(0).nbytes)
    _offer_tail(small, ns, first, seed=700)
    for i, key in enumerate(block_keys(chain(2, seed=1), ns, BLOCK)):  # push both out
        small.insert(key, make_block(800 + i))
    assert small.lookup(ns, first) == []
    assert not small._tails and not small._tail_of  # the evicted tail left the index


def test_blocks_evicted_from_ram_survive_a_restart(tmp_path: Path) -> None:
    """Blocks long evicted from a tiny RAM tier are on SSD, and a fresh cache on the same
    directory (a restart) restores every one."""
    ns = Namespace(model="spill2")
    tokens = chain(8, seed=1)
    keys = block_keys(tokens, ns, BLOCK)
    blocks = [make_block(200 + i) for i in range(len(keys))]
    cache = PrefixCache(2 * blocks[0].nbytes, tmp_path / "ssd", 64 * MiB)
    for key, block in zip(keys, blocks, strict=True):
        cache.insert(key, block)
    cache.close()
    reopened = PrefixCache(64 * MiB, tmp_path / "ssd", 64 * MiB)
    try:
        found = reopened.lookup(ns, tokens)
        assert len(found) == len(keys)
        assert reopened.snapshot()["ssd_hit_blocks"] == len(keys)
    finally:
        reopened.close()


def test_shutdown_persists_a_burst_larger_than_the_writer_queue(tmp_path: Path) -> None:
    """One offer of a long prompt inserts hundreds of blocks at once; close() (the daemon's
    shutdown) must still leave every RAM block on SSD."""
    ns = Namespace(model="persist")
    tokens = chain(600, seed=2)
    keys = block_keys(tokens, ns, BLOCK)
    block = make_block(7, layers=1, tokens=4, head_dim=4)
    cache = PrefixCache(256 * MiB, tmp_path / "ssd", 256 * MiB)
    for key in keys:
        cache.insert(key, block)
    assert len(cache.ram.entries) == len(keys)  # all of them fit in RAM
    cache.close()
    reopened = PrefixCache(256 * MiB, tmp_path / "ssd", 256 * MiB)
    try:
        assert len(reopened.lookup(ns, tokens)) == len(keys)
    finally:
        reopened.close()


def test_shutdown_persists_what_fits_the_writer_queue(tmp_path: Path) -> None:
    """Below the queue size nothing is lost: every block inserted before close() is on SSD."""
    ns = Namespace(model="persist-small")
    tokens = chain(100, seed=3)
    keys = block_keys(tokens, ns, BLOCK)
    cache = PrefixCache(256 * MiB, tmp_path / "ssd", 256 * MiB)
    for i, key in enumerate(keys):
        cache.insert(key, make_block(i, layers=1, tokens=8, head_dim=8))
    cache.close()
    reopened = PrefixCache(256 * MiB, tmp_path / "ssd", 256 * MiB)
    try:
        found = reopened.lookup(ns, tokens)
        assert len(found) == len(keys)
        for i, got in enumerate(found):
            assert_same_block(got, make_block(i, layers=1, tokens=8, head_dim=8))
    finally:
        reopened.close()


def test_ssd_volume_stays_near_its_limit(tmp_path: Path) -> None:
    limit = 2 * MiB
    block = make_block(8)  # ~32 KiB each
    tier = SsdTier(tmp_path / "ssd", limit)
    try:
        keys = [f"{i:064x}" for i in range(300)]  # ~10 MiB in all: five times the limit
        for start in range(0, len(keys), 20):
            for key in keys[start : start + 20]:
                tier.put_async(key, block)
            tier.flush()
            assert tier.nbytes <= 1.5 * limit + len(encode(keys[0], block))
        assert tier.dropped == 0
        # LRU: the newest entries survive, the oldest were culled.
        assert_same_block(tier.get(keys[-1]), block)
        assert tier.get(keys[0]) is None
        assert len(tier.cache) < len(keys)
    finally:
        tier.close()


# -- 8. kill -9 during SSD writes --------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.cache.blocks import kill_block, kill_keys
    from mlxd.engine.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 20, Path(sys.argv[1]), 1 << 30)
    for i, key in enumerate(kill_keys()):
        cache.insert(key, kill_block(i))
        if i % 8 == 7:
            cache.ssd.flush()
            print(i + 1, flush=True)
    print("finished", flush=True)
    """
)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_kill_9_during_ssd_writes_leaves_a_usable_cache(tmp_path: Path) -> None:
    directory = tmp_path / "ssd"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stderr = open(tmp_path / "writer.err", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(directory)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip
    flushed = 0
    try:
        assert proc.stdout is not None
        while flushed < 48 or _dir_bytes(directory) < 2 * MiB:
            line = proc.stdout.readline()
            assert line, "writer ended early: " + (tmp_path / "writer.err").read_text()
            assert line.strip() != "finished", "writer finished before it was killed"
            flushed = int(line)
        proc.send_signal(signal.SIGKILL)  # mid-stream: it keeps writing until killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        stderr.close()
    assert proc.returncode == -signal.SIGKILL

    keys = kill_keys()
    cache = PrefixCache(256 * MiB, directory, 1 << 30)
    try:
        assert cache.ssd is not None
        present = 0
        for i, key in enumerate(keys):
            got = cache.ssd.get(key)
            if got is not None:
                assert_same_block(got, kill_block(i))
                present += 1
            elif i < flushed:
                pytest.fail(f"block {i} was flushed before the kill but is gone")
        assert present >= flushed
        # A chained lookup restores the longest intact prefix, every block exact.
        tokens = kill_tokens()
        found = cache.lookup(KILL_NS, tokens)
        assert len(found) >= flushed
        for i, got in enumerate(found):
            assert_same_block(got, kill_block(i))
        # New writes and reads work.
        fresh = Namespace(model="after-kill")
        fresh_tokens = chain(3, seed=10)
        for i, key in enumerate(block_keys(fresh_tokens, fresh, BLOCK)):
            cache.ssd.put_async(key, make_block(500 + i))
        cache.ssd.flush()
        cache.ram = RamTier(cache.ram.budget)  # forget RAM: read back from SSD
        again = cache.lookup(fresh, fresh_tokens)
        assert len(again) == 3
        for i, got in enumerate(again):
            assert_same_block(got, make_block(500 + i))
    finally:
        cache.close()


def test_stats_endpoint_reports_the_prefix_cache(server: object) -> None:
    """`/api/mlxd/stats` shows tier sizes, hit rate and bytes restored."""
    import httpx

    base = server.base_url  # type: ignore[attr-defined]
    prompt = "def f(x):\n    return x\n" * 40
    body = {"model": "tiny", "prompt": prompt, "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 4, "draft_method": "off"}}  # fmt: skip
    httpx.post(f"{base}/api/generate", json=body, timeout=60)
    warm = httpx.post(f"{base}/api/generate", json=body, timeout=60).json()
    assert warm["prompt_cache_tokens"] > 0
    cache = httpx.get(f"{base}/api/mlxd/stats").json()["prefix_cache"]
    for key in ("ram_bytes", "ssd_bytes", "hit_rate", "restored_bytes", "hit_tokens", "lookups"):
        assert key in cache
    assert cache["hit_tokens"] >= warm["prompt_cache_tokens"]
    assert cache["restored_bytes"] > 0 and cache["ram_bytes"] > 0


# -- 4. a pairing whose speculation is paused still caches --------------------------------------


def _pause_speculation(srv: CacheServer, model: str) -> None:
    """Make `model`'s pairing remember that every draft source lost to plain decoding lately,
    as after a run of requests where speculation did not pay: the next request starts paused."""
    from mlxd.engine.speculation import SourceRecord

    generate(srv.base_url, model, "load", num_predict=1)  # load it
    entry = srv.state.registry().get(model)
    assert entry is not None
    pairing = srv.state.manager.loaded()[entry.name].runner.pairing
    assert pairing is not None
    losing = SourceRecord([1.0], [4.0], spec_seconds=4.0, plain_seconds=1.0)
    for source in ("model", "auto", "lookup"):
        pairing.history.record(f"{source}/greedy", losing)


@pytest.mark.parametrize("method", ["model", "auto"])
def test_a_long_prompt_is_cached_while_speculation_is_paused(
    shared: CacheServer, method: str
) -> None:
    """A paused draft never read the prompt (its prefill is deferred) and `auto` drops its
    draft model for prompt lookup: the blocks carrying the draft's state are still offered."""
    _pause_speculation(shared, "pair")
    prompt = prompt_text(f"paused-{method}", words=120)
    cold = generate(shared.base_url, "pair", prompt, draft_method=method)
    assert cold["prompt_cache_tokens"] == 0
    assert cold.get("draft_disabled_reason")  # paused (model), or stepped down to lookup (auto)
    warm = generate(shared.base_url, "pair", prompt, draft_method=method)
    assert warm["prompt_cache_tokens"] == all_but_last(cold["prompt_eval_count"])
    assert warm["response"] == cold["response"]


def _spilled(
    tmp_path: Path, ns: Namespace, n_blocks: int
) -> tuple[PrefixCache, list[int], list[Block]]:
    """A cache whose RAM holds one block: the rest of `n_blocks` went to the SSD."""
    tokens = chain(n_blocks, seed=7)
    blocks = [make_block(700 + i) for i in range(n_blocks)]
    cache = PrefixCache(blocks[0].nbytes, tmp_path / "ssd", 64 * MiB)
    for key, block in zip(block_keys(tokens, ns, BLOCK), blocks, strict=True):
        cache.insert(key, block)
    assert cache.ssd is not None
    cache.ssd.flush()
    return cache, tokens, blocks


def test_ssd_runs_are_read_in_parallel_in_order_up_to_the_first_miss(tmp_path: Path) -> None:
    ns = Namespace(model="runs")
    cache, tokens, blocks = _spilled(tmp_path, ns, 8)
    try:
        assert cache.ssd is not None
        keys = block_keys(tokens, ns, BLOCK)
        cache.ssd.cache.delete(keys[5])
        run = cache.ssd.get_run(keys[:5] + keys[5:])
        assert len(run) == 5
        for got, want in zip(run, blocks, strict=False):
            assert_same_block(got, want)
        assert cache.ssd.get_run([]) == []
    finally:
        cache.close()


def test_the_ssd_is_used_only_where_it_beats_recomputing(tmp_path: Path) -> None:
    """A disk slower than the model's prefill is skipped (the prompt is recomputed); a faster
    one, or an unknown prefill rate, is read."""
    ns = Namespace(model="costed")
    cache, tokens, _ = _spilled(tmp_path, ns, 6)
    try:
        assert cache.ssd is not None
        cache.ssd.read_rate = 1e6  # bytes/s
        slow_disk = cache.lookup(ns, tokens, recompute_rate=1e9)
        assert sum(b.tokens for b in slow_disk) < len(tokens)
        assert cache.stats.ssd_hit_blocks == 0
        assert cache.snapshot()["ssd_skipped_lookups"] == 1
        fast_disk = cache.lookup(ns, tokens, recompute_rate=1e3)
        assert sum(b.tokens for b in fast_disk) == len(tokens)
        assert cache.stats.ssd_hit_blocks > 0
    finally:
        cache.close()


def test_the_disk_read_rate_is_measured_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A killed process's probe files go; another daemon's on the same home, probing now, stay
    (they were deleted under it, and its measure failed)."""
    from concurrent.futures import ThreadPoolExecutor

    from mlxd.engine.prefix_cache import probe_read_rate
    from tests.registry.test_leftovers import dead_pid

    killed = tmp_path / f"read-probe-{dead_pid()}-0.tmp"
    killed.write_bytes(b"left by a killed process")
    probing = tmp_path / f"read-probe-{os.getppid()}-0.tmp"
    probing.write_bytes(b"another daemon's, being read")
    with ThreadPoolExecutor(2) as readers:
        assert probe_read_rate(tmp_path, readers) > 0
    assert list(tmp_path.iterdir()) == [probing]


def test_an_entry_is_written_from_a_copy_of_its_arrays() -> None:
    """On MLX's CUDA build a host read moves an array into unified memory for good: the SSD
    writer must read a copy, never the arrays the RAM tier restores from."""
    block = make_block(8)
    parts = pc.encoded(KEY, block)
    body = np.asarray(parts.chunks[-1])
    for layer in block.arrays:
        for a in layer:
            assert not np.shares_memory(body, np.asarray(a))
    assert parts.join() == encode(KEY, block)
    assert_same_block(decode(KEY, parts.join()), block)
