"""An adapter's files as mlx-lm writes them, read and checked without loading a model.

`mlx_lm.lora` saves `adapter_config.json` (every training argument; the loader reads
`fine_tune_type`, `num_layers` and `lora_parameters`) and `adapters.safetensors` (`<module>.lora_a`
(in, r), `<module>.lora_b` (r, out), and DoRA's `<module>.m` (out,)). Whether an adapter fits a
base is a question of shapes, which the safetensors headers of both answer: so `/api/create` and
probe-open refuse a mismatched adapter before anything is registered or mounted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.registry.store import (
    ADAPTER_FILES,
    ModelFilesError,
    _quant_bits,
    _weight_files,
    read_safetensors_header,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterFileError",
    "AdapterInfo",
    "adapter_revision",
    "block_counts",
    "check_fits",
    "check_layout",
    "read_adapter",
]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = ADAPTER_FILES
LEAVES = ("lora_a", "lora_b", "m")


class AdapterFileError(ValueError):
    """An adapter that is missing, corrupt, of an unsupported kind, or does not fit its base."""


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter directory holds (shapes only)."""

    path: Path
    kind: str  # "lora" | "dora"
    scale: float  # lora_parameters.scale
    rank: int
    modules: dict[str, dict[str, list[int]]]  # module path -> leaf -> shape
    num_layers: int = -1  # the blocks adapted, counted from the last (mlx-lm: <= 0 all)
    keys: tuple[str, ...] | None = None  # lora_parameters.keys (None: every projection)

    @property
    def dora(self) -> bool:
        return self.kind == "dora"


def _config(path: Path) -> dict[str, Any]:
    file = path / ADAPTER_CONFIG
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterFileError(f"adapter {path}: {ADAPTER_CONFIG} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise AdapterFileError(f"adapter {path}: {ADAPTER_CONFIG} is not valid JSON") from None
    if not isinstance(data, dict):
        raise AdapterFileError(f"adapter {path}: {ADAPTER_CONFIG} is not a JSON object")
    return data


def read_adapter(path: Path) -> AdapterInfo:
    """Read and check an adapter directory's config and tensor names; raises AdapterFileError."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterFileError(f"adapter {path} is not a directory")
    config = _config(path)
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterFileError(
            f"adapter {path}: fine_tune_type {kind!r} cannot be mounted on a shared base"
            " (only lora and dora; serve a full fine-tune as its own model)"
        )
    params = config.get("lora_parameters")
    scale = params.get("scale") if isinstance(params, dict) else None
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise AdapterFileError(f"adapter {path}: lora_parameters.scale is missing")
    if not math.isfinite(scale):
        raise AdapterFileError(f"adapter {path}: lora_parameters.scale must be a finite number")
    num_layers, keys, declared = _layout(path, config, params)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterFileError(f"adapter {path}: {ADAPTER_WEIGHTS} is missing")
    try:
        header = read_safetensors_header(weights)
    except ModelFilesError as exc:
        raise AdapterFileError(f"adapter {path}: {exc}") from None
    modules: dict[str, dict[str, list[int]]] = {}
    for name, info in header.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in LEAVES or not module:
            raise AdapterFileError(f"adapter {path}: {name} is not an adapter tensor")
        modules.setdefault(module, {})[leaf] = list(info["shape"])
    if not modules:
        raise AdapterFileError(f"adapter {path}: {ADAPTER_WEIGHTS} holds no tensors")
    rank = 0
    for module, leaves in modules.items():
        a, b = leaves.get("lora_a"), leaves.get("lora_b")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise AdapterFileError(
                f"adapter {path}: {module} needs lora_a (in, r) and lora_b (r, out)"
                " (mixture-of-experts and embedding adapters are not served)"
            )
        if ("m" in leaves) != (kind == "dora") or ("m" in leaves and leaves["m"] != [b[1]]):
            raise AdapterFileError(f"adapter {path}: {module}.m does not match a {kind} adapter")
        if declared is not None and a[1] != declared:
            raise AdapterFileError(
                f"adapter {path}: {module} has rank {a[1]} but {ADAPTER_CONFIG} says"
                f" lora_parameters.rank {declared}"
            )
        rank = max(rank, a[1])
    return AdapterInfo(path, kind, float(scale), rank, modules, num_layers, keys)


def _layout(
    path: Path, config: dict[str, Any], params: Any
) -> tuple[int, tuple[str, ...] | None, int | None]:
    """The config's `num_layers`, `lora_parameters.keys` and `lora_parameters.rank` (each
    optional), which mlx-lm's loader builds the adapted layers from."""
    num_layers = config.get("num_layers", -1)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise AdapterFileError(f"adapter {path}: num_layers must be an integer")
    keys = params.get("keys") if isinstance(params, dict) else None
    if keys is not None and (
        not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)
    ):
        raise AdapterFileError(f"adapter {path}: lora_parameters.keys must be a list of names")
    rank = params.get("rank") if isinstance(params, dict) else None
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise AdapterFileError(f"adapter {path}: lora_parameters.rank must be an integer")
    return num_layers, None if keys is None else tuple(keys), rank


def _block_of(module: str) -> tuple[str, int, str] | None:
    """(the block list's path, the block's index, the path within it) of a module path such as
    `model.layers.3.self_attn.q_proj`; None for a module outside numbered blocks."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def block_counts(modules: Iterable[str]) -> dict[str, int]:
    """The number of blocks of each block list that `modules` (a model's module paths) show."""
    counts: dict[str, int] = {}
    for module in modules:
        found = _block_of(module)
        if found is not None:
            counts[found[0]] = max(counts.get(found[0], 0), found[1] + 1)
    return counts


def check_layout(info: AdapterInfo, blocks: dict[str, int]) -> None:
    """Raise AdapterFileError for a tensor that the adapter's own config does not adapt, as
    mlx-lm's loader refuses it: a block before its last `num_layers`, a projection not among
    its `lora_parameters.keys`. `blocks`: the base's block count per block list
    (`block_counts`)."""
    for module in info.modules:
        if info.keys is not None and module in info.keys:
            continue  # a key naming the module's whole path: mlx-lm adapts it in any block
        found = _block_of(module)
        if found is None:
            raise AdapterFileError(
                f"adapter {info.path}: {module} is outside the blocks its {ADAPTER_CONFIG} adapts"
            )
        blocks_path, index, within = found
        count = blocks.get(blocks_path, 0)
        first = count - info.num_layers if 0 < info.num_layers < count else 0
        if index < first:
            raise AdapterFileError(
                f"adapter {info.path}: {module} is not among the last {info.num_layers} of"
                f" {count} blocks that its {ADAPTER_CONFIG} adapts (num_layers)"
            )
        if info.keys is not None and within not in info.keys:
            raise AdapterFileError(
                f"adapter {info.path}: {module} is not among its {ADAPTER_CONFIG}'s"
                f" lora_parameters.keys"
            )


# What mlx-lm's models name their token (and position) embeddings: 2-D weights as a projection's
# are, but layers mlxd's adapters are not applied to (mlx-lm's tuner can adapt embeddings)
EMBEDDINGS = frozenset({
    "embed", "embed_in", "embed_positions", "embed_tokens", "embed_tokens_per_layer",
    "embedding", "embeddings", "position_embedding_table", "position_embeddings",
    "tok_embeddings", "token_embeddings", "word_embeddings", "wpe", "wte",
})  # fmt: skip


def _base_blocks(config: dict[str, Any], shapes: dict[str, tuple[int, int]]) -> dict[str, int]:
    """The base's block count per block list as the loaded model has them: a checkpoint may
    hold multi-token-prediction blocks past `num_hidden_layers`
    (`num_nextn_predict_layers`: DeepSeek V3, GLM 4.5), which mlx-lm drops at load, so
    `num_layers` counts the last blocks from before them."""
    counts = block_counts(shapes)
    layers, extra = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if isinstance(layers, int) and isinstance(extra, int) and extra > 0:
        for path, count in counts.items():
            if count == layers + extra:
                counts[path] = layers
    return counts


def _base_config(base: Path) -> dict[str, Any]:
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError("config.json is not an object")
    return config


def _base_shapes(base: Path, config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of every projection weight in the base, unpacking quantized ones (embeddings
    left out)."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = int(quant.get("bits", 0)) if isinstance(quant, dict) else 0
    shapes: dict[str, tuple[int, int]] = {}
    for file in _weight_files(base):
        header = read_safetensors_header(file)
        for name, info in header.items():
            if not name.endswith(".weight") or len(info["shape"]) != 2:
                continue
            out, inner = info["shape"]
            module = name.removesuffix(".weight")
            if module.rpartition(".")[2] in EMBEDDINGS:
                continue
            if f"{module}.scales" in header and bits:
                inner = inner * 32 // _quant_bits(quant, name, bits)
            shapes[module] = (out, inner)
    return shapes


def check_fits(info: AdapterInfo, base: Path) -> None:
    """Raise AdapterFileError unless every adapted module is a projection of `base` with the
    adapter's shapes, in the blocks and among the projections its config names."""
    try:
        config = _base_config(base)
        shapes = _base_shapes(base, config)
    except (OSError, ValueError, ModelFilesError) as exc:
        raise AdapterFileError(f"cannot read the base model {base}: {exc}") from None
    for module, leaves in info.modules.items():
        found = shapes.get(module)
        if found is None:
            what = (
                f"{module} is an embedding (adapters apply to projections)"
                if module.rpartition(".")[2] in EMBEDDINGS
                else f"it has no projection {module}"
            )
            raise AdapterFileError(f"adapter {info.path} does not fit this base model: {what}")
        out, inner = found
        a, b = leaves["lora_a"], leaves["lora_b"]
        if a[0] != inner or b[1] != out:
            raise AdapterFileError(
                f"adapter {info.path} does not fit this base model: {module} is"
                f" ({inner} -> {out}) but the adapter is ({a[0]} -> {b[1]})"
            )
    check_layout(info, _base_blocks(config, shapes))


_HASHES: dict[tuple[str, int, int, int], str] = {}  # (path, inode, size, mtime) -> digest


def _file_hash(path: Path) -> str:
    """The file's SHA-256, read again only when its inode, size or mtime changed: every row
    on an adapter asks for its revision, and hashing megabytes per request on the pairing's
    thread would stall every other row."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    known = _HASHES.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    _HASHES[key] = found = digest.hexdigest()
    return found


def adapter_revision(paths: list[Path], scales: list[float | None]) -> str:
    """The content digest of adapters as mounted together (their files and scales): the
    prefix-cache namespace of rows on them, so a same-named adapter with new weights never
    meets the old one's K/V."""
    digest = hashlib.sha256()
    for path, scale in zip(paths, scales, strict=True):
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            digest.update(f"{name}:{_file_hash(Path(path) / name)};".encode())
        digest.update(f"scale:{scale};".encode())
    return digest.hexdigest()
