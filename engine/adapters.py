"""Adapters mounted on one loaded model: loaded from their files on first use, kept resident
within a byte budget (least recently used first out), each at a stable slot of the model's
`RowLoRA` layers (`engine.lora`).

A request on an adapter gets an `AdaptedModel`: the base model with every forward it makes
selecting that adapter's slot. A batch forward selects each row's slot (`selecting`). Mounting
happens on the pairing's thread between forwards, so no forward ever sees half a mount, and the
base is never reloaded. An adapter in use by a row is never dropped; the budget may be exceeded
while rows hold more adapters than it fits, never otherwise.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine.lora import (
    LayerWeights,
    RowLoRA,
    Selection,
    dora_ratio,
    wrap,
    wrap_for_decoding,
)
from mlxd.engine.memory import return_freed_memory
from mlxd.registry.adapterfiles import (
    ADAPTER_WEIGHTS,
    AdapterFileError,
    adapter_revision,
    block_counts,
    check_fits,
    check_layout,
    read_adapter,
)
from mlxd.registry.schema import AdapterRef
from mlxd.registry.store import resolve_adapter

log = logging.getLogger(__name__)

DEFAULT_ADAPTER_BYTES = 2 << 30  # adapters kept resident per loaded model

__all__ = [
    "DEFAULT_ADAPTER_BYTES",
    "AdaptedModel",
    "AdapterError",
    "AdapterSet",
    "Mount",
    "check_entry_adapters",
    "locate_adapters",
    "selecting",
]


class AdapterError(ValueError):
    """An adapter that cannot be mounted on this model; the message says which and why."""


def locate_adapters(refs: Sequence[AdapterRef]) -> list[Path]:
    """The local directories of `refs` (a hub repo must have been pulled)."""
    paths = []
    for ref in refs:
        path = resolve_adapter(ref.ref)
        if path is None:
            raise AdapterError(f"adapter '{ref.ref}' is not available locally; pull it first")
        paths.append(path)
    return paths


@dataclass(eq=False)
class Mount:
    """One adapter set mounted at a slot of the model's layers."""

    revision: str
    slot: int
    nbytes: int
    modules: list[str]
    users: int = 0


@dataclass
class _Loaded:
    revision: str
    layers: dict[str, LayerWeights] = field(default_factory=dict)


def _module(model: nn.Module, path: str) -> Any:
    node: Any = model
    for part in path.split("."):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return None
            node = node[int(part)]
        else:
            node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node.base if isinstance(node, RowLoRA) else node


def _dims(layer: Any) -> tuple[int, int]:
    """(in, out) of a linear projection, unpacking quantized weights."""
    out, inner = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        inner = inner * 32 // layer.bits
    return inner, out


def _read(model: nn.Module, path: Path, scale: float | None) -> tuple[dict[str, Any], float, bool]:
    info = read_adapter(path)
    try:
        tensors = mx.load(str(path / ADAPTER_WEIGHTS))
    except Exception as exc:
        raise AdapterError(f"adapter {path}: cannot read {ADAPTER_WEIGHTS}: {exc}") from None
    assert isinstance(tensors, dict)
    for module, leaves in info.modules.items():
        layer = _module(model, module)
        if not isinstance(layer, nn.Linear | nn.QuantizedLinear):
            raise AdapterError(
                f"adapter {path} does not fit this model: it has no projection {module}"
            )
        inner, out = _dims(layer)
        a, b = leaves["lora_a"], leaves["lora_b"]
        if a[0] != inner or b[1] != out:
            raise AdapterError(
                f"adapter {path} does not fit this model: {module} is ({inner} -> {out})"
                f" but the adapter is ({a[0]} -> {b[1]})"
            )
    check_layout(info, block_counts(name for name, _ in model.named_modules()))
    return tensors, info.scale if scale is None else scale, info.dora


def load_adapters(model: nn.Module, paths: list[Path], scales: list[float | None]) -> _Loaded:
    """Read adapters and check them against `model`; several are summed (LoRA only), their
    ranks concatenated with each scale folded into its B."""
    try:
        revision = adapter_revision(paths, scales)
        read = [_read(model, p, s) for p, s in zip(paths, scales, strict=True)]
    except (AdapterFileError, OSError) as exc:
        raise AdapterError(str(exc)) from None
    loaded = _Loaded(revision)
    if len(read) == 1:
        tensors, scale, dora = read[0]
        modules = {name.rpartition(".")[0] for name in tensors}
        for module in sorted(modules):
            a, b = tensors[f"{module}.lora_a"], tensors[f"{module}.lora_b"]
            ratio = None
            if dora:
                ratio = dora_ratio(_module(model, module), a, b, scale, tensors[f"{module}.m"])
            loaded.layers[module] = LayerWeights(a, b, scale, ratio)
        return loaded
    if any(dora for _, _, dora in read):
        raise AdapterError("DoRA adapters cannot be combined with other adapters")
    parts: dict[str, list[tuple[mx.array, mx.array]]] = {}
    for tensors, scale, _ in read:
        for name in tensors:
            module, _, leaf = name.rpartition(".")
            if leaf == "lora_a":
                b = tensors[f"{module}.lora_b"]
                parts.setdefault(module, []).append((tensors[name], scale * b))
    for module, pairs in parts.items():
        a = mx.concatenate([p[0] for p in pairs], axis=1)
        b = mx.concatenate([p[1] for p in pairs], axis=0)
        loaded.layers[module] = LayerWeights(a, b, 1.0)
    return loaded


class AdaptedModel:
    """`model` as one adapter sees it: every forward selects `slot` for all its rows."""

    def __init__(self, model: nn.Module, selection: Selection, mount: Mount) -> None:
        self.model = model
        self.selection = selection
        self.mount = mount

    @property
    def slot(self) -> int:
        return self.mount.slot

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.selection.set([self.mount.slot])
        try:
            return self.model(*args, **kwargs)
        finally:
            self.selection.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@contextlib.contextmanager
def selecting(models: Sequence[Any]) -> Iterator[None]:
    """Within: a forward of the base model runs row i on `models[i]`'s adapter (rows past the
    list, e.g. padding, on the base)."""
    views = [m for m in models if isinstance(m, AdaptedModel)]
    if not views:
        yield
        return
    selection = views[0].selection
    selection.set([m.slot if isinstance(m, AdaptedModel) else 0 for m in models])
    try:
        yield
    finally:
        selection.clear()


class AdapterSet:
    """The adapters mounted on one model (on its pairing's thread only)."""

    def __init__(self, model: nn.Module, max_bytes: int = DEFAULT_ADAPTER_BYTES) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self.selection = Selection()
        wrap_for_decoding(model, self.selection)
        self._mounts: OrderedDict[str, Mount] = OrderedDict()  # least recently used first
        self.loads = 0  # adapters read from files (a reload of the base is never one)
        self.count = 0  # resident adapters and their bytes, readable from any thread
        self.resident_bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._mounts.values())

    def mounted(self) -> list[Mount]:
        return list(self._mounts.values())

    def acquire(self, refs: Sequence[AdapterRef]) -> AdaptedModel:
        """The model on `refs` (mounted now unless resident); the caller `release`s it."""
        paths = locate_adapters(refs)
        scales = [r.scale for r in refs]
        try:
            revision = adapter_revision(paths, scales)
        except OSError as exc:
            raise AdapterError(f"cannot read adapter files: {exc}") from None
        mount = self._mounts.get(revision)
        if mount is None:
            mount = self._mount(load_adapters(self.model, paths, scales))
        self._mounts.move_to_end(revision)
        mount.users += 1
        self._trim()
        return AdaptedModel(self.model, self.selection, mount)

    def release(self, view: AdaptedModel) -> None:
        view.mount.users = max(0, view.mount.users - 1)
        self._trim()

    def _mount(self, loaded: _Loaded) -> Mount:
        taken = {m.slot for m in self._mounts.values()}
        slot = next(s for s in range(1, len(taken) + 2) if s not in taken)
        mount = Mount(loaded.revision, slot, 0, sorted(loaded.layers))
        for module, weights in loaded.layers.items():  # bytes as held: the base's dtype, padded
            mount.nbytes += wrap(self.model, module, self.selection).put(slot, weights)
        mx.clear_cache()  # the stacks it replaced: their memory goes back, not to MLX's cache
        return_freed_memory()  # and the host heap's: the files as read, the kernels' builds
        self._mounts[loaded.revision] = mount
        self.loads += 1
        self._counted()
        log.info(
            "mounted adapter %s at slot %d (%d bytes)", loaded.revision[:12], slot, mount.nbytes
        )
        return mount

    def _counted(self) -> None:
        self.count, self.resident_bytes = len(self._mounts), self.nbytes

    def _trim(self) -> None:
        """Drop unused adapters, least recently used first, until the rest fit the budget."""
        dropped = False
        for revision, mount in list(self._mounts.items()):
            if self.nbytes <= self.max_bytes:
                break
            if mount.users:
                continue
            for module in mount.modules:
                wrap(self.model, module, self.selection).put(mount.slot, None)
            del self._mounts[revision]
            dropped = True
            self._counted()
            log.info("dropped adapter %s (least recently used)", revision[:12])
        if dropped:
            mx.clear_cache()
            return_freed_memory()


def check_entry_adapters(
    adapters: Sequence[AdapterRef],
    base: Path,
    draft_adapters: Sequence[AdapterRef] = (),
    draft: Path | None = None,
) -> None:
    """Refuse (AdapterError) adapters that are missing, broken, or shaped for another base;
    reads only files, so it runs before anything is loaded or registered."""
    groups = [(adapters, base), (draft_adapters, draft)]
    for refs, model_dir in groups:
        if not refs:
            continue
        if model_dir is None:
            raise AdapterError("draft_adapters name adapters for a draft, but there is no draft")
        for ref, path in zip(refs, locate_adapters(refs), strict=True):
            try:
                info = read_adapter(path)
                check_fits(info, model_dir)
            except AdapterFileError as exc:
                raise AdapterError(str(exc)) from None
            if info.dora and len(refs) > 1:
                raise AdapterError(f"adapter {ref.ref}: DoRA adapters cannot be combined")
