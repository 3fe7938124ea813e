"""Where a model's files are and what they contain, without importing mlx.

``/api/tags`` and ``/api/show`` must list models that are not loaded (and may never fit in
memory), so everything here reads only ``config.json`` and the JSON headers of the
safetensors files, never the weights themselves. The one expensive operation, hashing for
the digest, is cached per file.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from mlxd.registry.home import ensure_home

if TYPE_CHECKING:
    from mlxd.registry.schema import ModelEntry

__all__ = [
    "DIGEST_CACHE_FILENAME",
    "MODEL_FILE_PATTERNS",
    "ModelDetails",
    "ModelFilesError",
    "files_present",
    "hub_cache_dir",
    "human_number",
    "model_digest",
    "model_files",
    "model_size",
    "read_details",
    "read_safetensors_header",
    "resolve_adapter",
    "resolve_local",
]

# An adapter in mlx-lm's layout: its config and final weights (a training run's folder also
# holds numbered checkpoints, `0000100_adapters.safetensors`, which are not fetched)
ADAPTER_FILES: tuple[str, ...] = ("adapter_config.json", "adapters.safetensors")

# What a model needs on disk (the same set mlx_lm downloads): weights, configs and index,
# tokenizer files in their various formats, and chat templates.
MODEL_FILE_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "tiktoken.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)

DIGEST_CACHE_FILENAME = "digests.json"

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB
_CHUNK = 4 * 1024 * 1024
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_CONFIG_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
}


class ModelFilesError(Exception):
    """A model directory whose files are missing, unreadable or corrupt."""


# --- locating ----------------------------------------------------------------------------


def hub_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The Hugging Face hub cache, read from the environment at call time.

    ``huggingface_hub`` reads ``HF_HOME``/``HF_HUB_CACHE`` once at import; re-reading them
    here lets a running process (and tests) point at another cache.
    """
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(os.path.expandvars(env[var])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    return Path(hf_constants.HF_HUB_CACHE)


def _looks_like_path(ref: str) -> bool:
    return (
        ref.startswith(("~", ".", "/")) or os.path.isabs(ref) or "\\" in ref or ref.count("/") > 1
    )


def is_complete_model(model_dir: Path) -> bool:
    """Whether a directory has a config and every weight file it promises."""
    if not (model_dir / "config.json").is_file():
        return False
    try:
        weights = _weight_files(model_dir)
    except ModelFilesError:
        return False
    return bool(weights) and all(w.is_file() for w in weights)


def files_present(entry: ModelEntry, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the entry's models and adapters are here (a hub repository in the local cache,
    a directory on disk): an entry short of one is a model not pulled yet, as Ollama has a
    model whose layers are not all there (what is wrong with files that are here is said
    where the entry is probed)."""
    models = [ref for ref in (entry.target, entry.draft) if ref]
    adapters = [a.ref for a in (*entry.adapters, *entry.draft_adapters)]
    return all(resolve_local(ref, env=env) is not None for ref in models) and all(
        resolve_adapter(ref, env=env) is not None for ref in adapters
    )


def is_complete_adapter(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ADAPTER_FILES)


def resolve_adapter(ref: str, *, env: Mapping[str, str] = os.environ) -> Path | None:
    """The local directory of an adapter (a directory path, or a hub repo pulled into the
    Hugging Face cache), or None where it is not fully present."""
    return resolve_local(ref, env=env, adapter=True)


def resolve_local(
    ref: str,
    *,
    revision: str | None = None,
    env: Mapping[str, str] = os.environ,
    adapter: bool = False,
) -> Path | None:
    """The local directory holding ``ref``'s files (a model's; with `adapter`, an adapter's),
    or None if it is not fully present.

    ``ref`` is a directory path or a hub repo id. A repo id is looked up only in the user's
    Hugging Face cache (``local_files_only``), so listing models never touches the network.
    """
    if not ref:
        return None
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve()
    if _looks_like_path(ref):
        return None
    try:
        folder = snapshot_download(
            repo_id=ref,
            revision=revision,
            local_files_only=True,
            allow_patterns=list(ADAPTER_FILES if adapter else MODEL_FILE_PATTERNS),
            cache_dir=hub_cache_dir(env),
        )
    except (
        LocalEntryNotFoundError,
        EntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        OfflineModeIsEnabled,
        HFValidationError,
        OSError,
    ):
        return None
    snapshot = Path(folder)
    complete = is_complete_adapter if adapter else is_complete_model
    return snapshot if complete(snapshot) else None


def model_files(model_dir: Path) -> list[Path]:
    """The files of ``model_dir`` matching :data:`MODEL_FILE_PATTERNS`, sorted by name.

    Only the top level is considered, as mlx_lm does; symlinks (hub cache snapshots) count.
    """
    model_dir = Path(model_dir)
    try:
        children = list(model_dir.iterdir())
    except OSError as exc:
        raise ModelFilesError(
            f"cannot list model directory {model_dir}: {exc.strerror or exc}"
        ) from exc
    files = [
        child
        for child in children
        if any(fnmatch.fnmatchcase(child.name, pat) for pat in MODEL_FILE_PATTERNS)
        and (child.is_symlink() or child.is_file())
    ]
    return sorted(files, key=lambda p: p.name)


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as exc:
        raise ModelFilesError(
            f"model file {path} is missing or unreadable: {exc.strerror or exc}"
        ) from exc


def model_size(model_dir: Path) -> int:
    """Total bytes of the model files (what ``/api/tags`` reports as ``size``)."""
    return sum(_stat(f).st_size for f in model_files(model_dir))


# --- details -----------------------------------------------------------------------------


def human_number(n: int) -> str:
    """Ollama's ``format.HumanNumber``: ``8.0B``, ``494.03M``, ``26K``."""
    for scale, suffix, decimals in ((1_000_000_000, "B", 1), (1_000_000, "M", 2)):
        if n >= scale:
            value = n / scale
            return (
                f"{value:.0f}{suffix}"
                if value == math.floor(value)
                else f"{value:.{decimals}f}{suffix}"
            )
    if n >= 1_000:
        return f"{n / 1_000:.0f}K"
    return str(n)


@dataclass(frozen=True)
class ModelDetails:
    """What ``/api/tags`` and ``/api/show`` say about a model, read from its files."""

    format: str = "safetensors"
    family: str = ""
    families: tuple[str, ...] = ()
    parameter_size: str = ""
    quantization_level: str = ""
    context_length: int | None = None
    embedding_length: int | None = None
    architecture: str = ""
    block_count: int | None = None
    head_count: int | None = None
    head_count_kv: int | None = None
    parameter_count: int = 0
    parent_model: str = ""

    def ollama_details(self) -> dict[str, Any]:
        """The ``details`` object of ``/api/tags``, ``/api/ps`` and ``/api/show``."""
        out: dict[str, Any] = {
            "parent_model": self.parent_model,
            "format": self.format,
            "family": self.family,
            "families": list(self.families) if self.families else None,
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization_level,
        }
        if self.context_length is not None:
            out["context_length"] = self.context_length
        if self.embedding_length is not None:
            out["embedding_length"] = self.embedding_length
        return out

    def model_info(self) -> dict[str, Any]:
        """GGUF-style ``model_info`` keys for ``/api/show`` (absent values are left out)."""
        arch = self.architecture or self.family or "unknown"
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": self.parameter_count,
            # clients size prompts from this key, so it is always present
            f"{arch}.context_length": self.context_length or 0,
        }
        for key, value in (
            ("embedding_length", self.embedding_length),
            ("block_count", self.block_count),
            ("attention.head_count", self.head_count),
            ("attention.head_count_kv", self.head_count_kv),
        ):
            if value is not None:
                info[f"{arch}.{key}"] = value
        return info


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelFilesError(f"{path} is missing") from exc
    except OSError as exc:
        raise ModelFilesError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFilesError(f"{path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ModelFilesError(f"{path} is not valid JSON: nested too deeply") from None


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> ``{"dtype", "shape", "data_offsets"}`` from a safetensors file's header.

    The format is an 8-byte little-endian header length followed by that much JSON, so this
    reads a few kilobytes however large the file is.
    """
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            size = os.fstat(f.fileno()).st_size
            if len(prefix) < 8:
                raise ModelFilesError(f"{path} is truncated: no safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length < 2 or length > min(size - 8, _HEADER_LIMIT):
                raise ModelFilesError(f"{path} is corrupt: bad safetensors header length {length}")
            raw = f.read(length)
    except OSError as exc:
        raise ModelFilesError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelFilesError(f"{path} is corrupt: safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise ModelFilesError(f"{path} is corrupt: safetensors header is not an object")
    tensors: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("dtype"), str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ModelFilesError(f"{path} is corrupt: bad entry for tensor {name!r}")
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelFilesError(f"{path} is corrupt: bad data offsets for tensor {name!r}")
        if 8 + length + offsets[1] > size:  # a file cut short (a copy or download cut)
            raise ModelFilesError(
                f"{path} is truncated: tensor {name!r} ends past the end of the file"
            )
        tensors[name] = info
    return tensors


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files the loader will read: the index's shards, else ``model*``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelFilesError(f"{index} is corrupt: no weight_map")
        return [model_dir / str(name) for name in sorted(set(weight_map.values()))]
    shards = sorted(model_dir.glob("model*.safetensors"))
    return shards or sorted(model_dir.glob("*.safetensors"))


def _first_int(configs: Iterable[Mapping[str, Any]], *keys: str) -> int | None:
    for config in configs:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _quant_bits(quant: Mapping[str, Any], tensor: str, default: int) -> int:
    """Bits of a packed tensor, honouring mlx_lm's per-module overrides in the config."""
    module = tensor.rsplit(".", 1)[0]
    override = quant.get(module)
    if isinstance(override, Mapping) and isinstance(override.get("bits"), int):
        return int(override["bits"])
    return default


def read_details(model_dir: Path, *, context_length: int | None = None) -> ModelDetails:
    """Read a model's details from ``config.json`` and the safetensors headers.

    ``context_length`` is the registry's override, which wins over the config's
    ``max_position_embeddings``. Raises :class:`ModelFilesError`.
    """
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise ModelFilesError(f"{model_dir / 'config.json'} is not a JSON object")
    text_config = config.get("text_config")
    # Multimodal configs keep the language model's sizes under text_config.
    configs: list[Mapping[str, Any]] = [config]
    if isinstance(text_config, dict):
        configs.append(text_config)

    model_type = config.get("model_type")
    family = model_type if isinstance(model_type, str) else ""

    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if not isinstance(bits, int) or isinstance(bits, bool) or bits <= 0:
        quant, bits = None, None

    weights = _weight_files(model_dir)
    if not weights:
        raise ModelFilesError(f"no safetensors weights in {model_dir}")
    count = 0
    dtype_elements: dict[str, int] = {}
    for weight in weights:
        for name, info in read_safetensors_header(weight).items():
            dtype: str = info["dtype"]
            elements = math.prod(info["shape"])
            if quant is not None and bits is not None:
                if name.endswith((".scales", ".biases")):
                    continue
                if dtype == "U32":
                    elements = elements * 32 // _quant_bits(quant, name, bits)
            count += elements
            if dtype in _FLOAT_DTYPES:
                dtype_elements[dtype] = dtype_elements.get(dtype, 0) + elements

    if bits is not None:
        level = f"Q{bits}"
    elif dtype_elements:
        level = max(dtype_elements.items(), key=lambda kv: kv[1])[0]
    else:
        raw_dtype = config.get("torch_dtype") or config.get("dtype")
        level = _CONFIG_DTYPES.get(str(raw_dtype).lower(), "") if raw_dtype else ""

    head_count = _first_int(configs, "num_attention_heads", "n_head", "num_heads")
    return ModelDetails(
        family=family,
        families=(family,) if family else (),
        parameter_size=human_number(count),
        quantization_level=level,
        context_length=context_length
        if context_length is not None
        else _first_int(configs, "max_position_embeddings", "n_positions", "max_seq_len"),
        embedding_length=_first_int(configs, "hidden_size", "n_embd", "d_model"),
        architecture=family,
        block_count=_first_int(configs, "num_hidden_layers", "n_layer", "num_layers"),
        head_count=head_count,
        head_count_kv=_first_int(configs, "num_key_value_heads", "n_head_kv") or head_count,
        parameter_count=count,
    )


# --- digest ------------------------------------------------------------------------------

_cache_lock = threading.Lock()


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise ModelFilesError(f"cannot read model file {path}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def _load_cache(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # absent or damaged: it is only a cache
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def _save_cache(path: Path, updates: Mapping[str, dict[str, Any]]) -> None:
    """Merge ``updates`` into the on-disk cache atomically; failures only cost a rehash later."""
    with _cache_lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            files = _load_cache(path)
            files.update(updates)
            files = {k: v for k, v in files.items() if os.path.exists(k)}
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"version": 1, "files": files}, indent=0), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass


def model_digest(model_dir: Path, *, cache_path: Path | None = None) -> str:
    """A stable 64-hex sha256 identifying the model's contents (the ``digest`` Ollama lists).

    It hashes the sorted (name, size, sha256) of the model files, so it changes whenever a
    file does and not when the directory moves. Per-file hashes are cached in
    ``<MLXD_HOME>/digests.json`` keyed by real path and checked against size and mtime_ns,
    so listing large models again does not reread them.
    """
    files = model_files(model_dir)
    if not files:
        raise ModelFilesError(f"no model files in {model_dir}")
    hashes = file_hashes(files, cache_path=cache_path)
    total = hashlib.sha256()
    for file, (size, file_hash) in zip(files, hashes, strict=True):
        total.update(f"{file.name}\0{size}\0{file_hash}\n".encode())
    return total.hexdigest()


def _digest_cache(cache_path: Path | None) -> Path | None:
    if cache_path is not None:
        return cache_path
    try:
        return ensure_home() / DIGEST_CACHE_FILENAME
    except OSError:
        return None


def file_hashes(files: Sequence[Path], *, cache_path: Path | None = None) -> list[tuple[int, str]]:
    """(size, sha256) of each file, read from the digest cache while a file's size and
    modification time are those it was hashed at, else hashed (and remembered)."""
    cache_path = _digest_cache(cache_path)
    cache = _load_cache(cache_path) if cache_path is not None else {}
    updates: dict[str, dict[str, Any]] = {}
    out: list[tuple[int, str]] = []
    for file in files:
        st = _stat(file)
        real = str(file.resolve())
        hit = cache.get(real)
        if (
            isinstance(hit, dict)
            and hit.get("size") == st.st_size
            and hit.get("mtime_ns") == st.st_mtime_ns
            and isinstance(hit.get("sha256"), str)
        ):
            file_hash: str = hit["sha256"]
        else:
            file_hash = _hash_file(file)
            updates[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_hash}
        out.append((st.st_size, file_hash))
    if updates and cache_path is not None:
        _save_cache(cache_path, updates)
    return out


def remember_hash(path: Path, sha256: str, *, cache_path: Path | None = None) -> None:
    """Record a file's sha256 just verified (a download), so it is not read again."""
    cache_path = _digest_cache(cache_path)
    if cache_path is None:
        return
    with contextlib.suppress(OSError):
        st = path.stat()
        entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
        _save_cache(cache_path, {str(path.resolve()): entry})
