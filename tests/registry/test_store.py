"""Model files without mlx: locating, details from headers, size and digest."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from mlxd.registry import store
from mlxd.registry.store import (
    MODEL_FILE_PATTERNS,
    ModelDetails,
    ModelFilesError,
    human_number,
    model_digest,
    model_files,
    model_size,
    read_details,
    read_safetensors_header,
    resolve_local,
)

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I64": 8}


def write_safetensors(path: Path, tensors: Mapping[str, tuple[str, Sequence[int]]]) -> None:
    """A minimal valid safetensors file: length-prefixed JSON header, then zeroed data."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = _DTYPE_BYTES[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def make_model(
    root: Path, config: Mapping[str, object], tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    write_safetensors(root / "model.safetensors", tensors)
    return root


def test_patterns() -> None:
    assert {"*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"} <= set(
        MODEL_FILE_PATTERNS
    )


def test_read_header(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": ("F32", [2, 3]), "b": ("F16", [])})
    header = read_safetensors_header(path)
    assert header["a"]["shape"] == [2, 3] and header["b"]["dtype"] == "F16"
    assert "__metadata__" not in header


def test_details_full_precision(tmp_path: Path) -> None:
    model = make_model(
        tmp_path / "m",
        {**LLAMA_CONFIG, "torch_dtype": "float32"},
        {"embed.weight": ("F32", [100, 64]), "norm.weight": ("F32", [64])},
    )
    d = read_details(model)
    assert d == ModelDetails(
        format="safetensors",
        family="llama",
        families=("llama",),
        parameter_size="6K",
        quantization_level="F32",
        context_length=2048,
        embedding_length=64,
        architecture="llama",
        block_count=2,
        head_count=4,
        head_count_kv=2,
        parameter_count=100 * 64 + 64,
    )
    assert d.ollama_details()["families"] == ["llama"]
    assert d.ollama_details()["context_length"] == 2048
    assert d.model_info()["llama.attention.head_count_kv"] == 2
    assert d.model_info()["general.parameter_count"] == 6464


def test_details_dtype_from_header_then_config(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F16", [10, 10]), "b": ("F32", [10])})
    assert read_details(model).quantization_level == "F16"  # the dominant dtype on disk
    ints = make_model(tmp_path / "i", LLAMA_CONFIG, {"ids": ("I64", [4])})
    assert read_details(ints).quantization_level == "BF16"  # no float tensors: config dtype


def test_details_quantized(tmp_path: Path) -> None:
    config = {
        **LLAMA_CONFIG,
        "quantization": {
            "group_size": 64,
            "bits": 4,
            "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
        },
    }
    tensors = {
        # 4-bit: a [256, 512] matrix packs 8 values per uint32 -> [256, 64].
        "model.layers.0.self_attn.q_proj.weight": ("U32", [256, 64]),
        "model.layers.0.self_attn.q_proj.scales": ("BF16", [256, 8]),
        "model.layers.0.self_attn.q_proj.biases": ("BF16", [256, 8]),
        # 8-bit override: [128, 256] packs 4 per uint32 -> [128, 64].
        "model.layers.0.mlp.down_proj.weight": ("U32", [128, 64]),
        "model.layers.0.mlp.down_proj.scales": ("BF16", [128, 4]),
        "model.norm.weight": ("BF16", [512]),
    }
    d = read_details(make_model(tmp_path / "q", config, tensors), context_length=512)
    assert d.parameter_count == 256 * 512 + 128 * 256 + 512
    assert d.parameter_size == "164K"
    assert d.quantization_level == "Q4"
    assert d.context_length == 512  # the registry override wins


def test_details_sharded_and_text_config(tmp_path: Path) -> None:
    root = tmp_path / "vlm"
    root.mkdir()
    config = {
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "max_position_embeddings": 4096,
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    write_safetensors(root / "model-00001-of-00002.safetensors", {"a": ("BF16", [1000, 1000])})
    write_safetensors(root / "model-00002-of-00002.safetensors", {"b": ("BF16", [26_000, 1000])})
    (root / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    d = read_details(root)
    assert d.parameter_count == 27_000_000 and d.parameter_size == "27M"
    assert (d.embedding_length, d.block_count, d.head_count, d.head_count_kv) == (32, 3, 2, 2)
    assert d.context_length == 4096 and d.quantization_level == "BF16"


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (999, "999"),
        (26_000, "26K"),
        (26_210_000, "26.21M"),
        (26_000_000, "26M"),
        (494_032_768, "494.03M"),
        (8_030_261_248, "8.0B"),
        (7_000_000_000, "7B"),
        (70_553_706_496, "70.6B"),
    ],
)
def test_human_number_matches_ollama(n: int, text: str) -> None:
    assert human_number(n) == text


def test_details_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFilesError, match=r"config\.json is missing"):
        read_details(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelFilesError, match="not valid JSON"):
        read_details(empty)
    (empty / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    with pytest.raises(ModelFilesError, match="no safetensors weights"):
        read_details(empty)
    (empty / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ModelFilesError, match="truncated"):
        read_details(empty)
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelFilesError, match="bad safetensors header length"):
        read_details(empty)
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ModelFilesError, match="not JSON"):
        read_details(empty)
    bad = json.dumps({"w": {"dtype": "F32", "shape": [-1]}}).encode()
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad)
    with pytest.raises(ModelFilesError, match="bad entry for tensor 'w'"):
        read_details(empty)
    (empty / "model.safetensors").unlink()
    (empty / "model.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(ModelFilesError):
        read_details(empty)


def test_files_and_size(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F32", [4])})
    (model / "README.md").write_text("not a model file")
    (model / "chat_template.jinja").write_text("{{ x }}")
    (model / ".hidden.json.lock").write_text("")
    (model / "sub").mkdir()
    (model / "sub" / "x.json").write_text("{}")
    names = [p.name for p in model_files(model)]
    assert names == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json"]
    assert model_size(model) == sum((model / n).stat().st_size for n in names)


def test_digest_is_stable_and_content_based(tmp_path: Path) -> None:
    cache = tmp_path / "digests.json"
    a = make_model(tmp_path / "a", LLAMA_CONFIG, {"w": ("F32", [4])})
    b = make_model(tmp_path / "b", LLAMA_CONFIG, {"w": ("F32", [4])})
    da = model_digest(a, cache_path=cache)
    assert len(da) == 64 and int(da, 16) >= 0
    assert model_digest(a, cache_path=cache) == da
    assert model_digest(b, cache_path=tmp_path / "other.json") == da  # same bytes, other place
    (b / "tokenizer.json").write_text('{"changed": true}')
    assert model_digest(b, cache_path=cache) != da


def test_digest_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "digests.json"
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F32", [4])})
    calls: list[Path] = []
    real_hash = store._hash_file

    def counting(path: Path) -> str:
        calls.append(path)
        return real_hash(path)

    monkeypatch.setattr(store, "_hash_file", counting)
    first = model_digest(model, cache_path=cache)
    assert len(calls) == 3
    entries = json.loads(cache.read_text())["files"]
    assert str((model / "config.json").resolve()) in entries

    calls.clear()
    assert model_digest(model, cache_path=cache) == first
    assert calls == []  # nothing rehashed

    # A changed file (new size/mtime) is rehashed; the others still come from the cache.
    cfg = model / "config.json"
    cfg.write_text(json.dumps({**LLAMA_CONFIG, "extra": 1}))
    os.utime(cfg, ns=(1, 1))
    assert model_digest(model, cache_path=cache) != first
    assert calls == [cfg]


def test_digest_survives_bad_cache_and_defaults_to_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F32", [4])})
    digest = model_digest(model)
    cache = tmp_path / "home" / "digests.json"
    assert cache.is_file()
    cache.write_text("{garbage")
    assert model_digest(model) == digest
    assert json.loads(cache.read_text())["files"]  # rewritten


def test_digest_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match="cannot list model directory"):
        model_digest(tmp_path / "absent", cache_path=tmp_path / "c.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFilesError, match="no model files"):
        model_digest(tmp_path / "empty", cache_path=tmp_path / "c.json")
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F32", [4])})
    (model / "extra.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(ModelFilesError, match="missing or unreadable"):
        model_digest(model, cache_path=tmp_path / "c.json")
    with pytest.raises(ModelFilesError):
        model_size(model)


def _fake_hub_snapshot(hub: Path, repo_id: str, files: Mapping[str, bytes]) -> Path:
    """Lay out a repo in the hub cache format: blobs, refs/main and a snapshot of symlinks."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return tmp_path / "hf"


def test_resolve_local_directory(tmp_path: Path, hf_home: Path) -> None:
    model = make_model(tmp_path / "m", LLAMA_CONFIG, {"w": ("F32", [4])})
    assert resolve_local(str(model)) == model.resolve()
    assert resolve_local(str(tmp_path / "not-there")) is None
    assert resolve_local("./not-there") is None
    assert resolve_local("") is None


def test_resolve_local_missing_repo(hf_home: Path) -> None:
    assert resolve_local("mlx-community/definitely-not-downloaded") is None
    assert resolve_local("not a repo id!") is None


def test_resolve_local_cached_repo(tmp_path: Path, hf_home: Path) -> None:
    weights = tmp_path / "w.safetensors"
    write_safetensors(weights, {"w": ("F32", [4])})
    snapshot = _fake_hub_snapshot(
        hf_home / "hub",
        "org/complete",
        {
            "config.json": json.dumps(LLAMA_CONFIG).encode(),
            "model.safetensors": weights.read_bytes(),
        },
    )
    found = resolve_local("org/complete")
    assert found == snapshot
    assert read_details(found).parameter_count == 4
    assert model_size(found) == weights.stat().st_size + len(json.dumps(LLAMA_CONFIG))

    # Only the config got downloaded: not usable, so not "present".
    _fake_hub_snapshot(hf_home / "hub", "org/partial", {"config.json": b"{}"})
    assert resolve_local("org/partial") is None
