"""Prefix cache: committed K/V in fixed-size token blocks, in RAM and on SSD.

A block's key chains its parent's key, its tokens and the target's namespace (everything that
changes the target's K/V: model revision and compute dtype, adapter, KV quantization), so a
lookup walks the prompt block by block and stops at the first miss. A block holds every layer of
the target; a draft model's layers for the same tokens are an attachment filed under the
block's key and the draft's revision. Every request on the target shares the blocks whatever
its draft method; one with a draft model restores the attachments of the leading blocks that
have them, and its draft reads the rest of the prompt itself. A prompt's last, partial block is kept too, in RAM only, filed under its parent block,
so a repeated or extended prompt restores up to the token where it diverges from an earlier one;
a prompt that diverges inside a cached block (full or partial) restores that block's shared
first rows, found through an index of the blocks under each parent (`_longest_common`).
RAM is an LRU bounded by bytes; what it evicts spills to SSD. SSD writes happen on a
writer thread (decoding never waits on disk); every SSD entry is versioned and checksummed, and
anything that does not verify is a miss. The SSD directory itself is never trusted (see
`engine.ssd_store`), and one that cannot be used turns the SSD tier off, not the daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import sqlite3
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from crc32c import crc32c
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxd.engine.kvcache import new_kv_cache
from mlxd.engine.ssd_store import BadEntry, Parts, Reclaimed, StoreUnavailable, open_store
from mlxd.engine.threads import start_mlx_thread
from mlxd.registry.leftovers import writer_running

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: CRC32C (was zlib's CRC32)
MAGIC = b"MLXDKV\x00\x02"
DEFAULT_BLOCK = 64


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides what a cached K/V block contains."""

    model: str
    adapter: str = ""
    kv: str = ""  # "bits/group_size/start" when the KV cache is quantized

    @property
    def seed(self) -> bytes:
        return hashlib.sha256(
            json.dumps([FORMAT_VERSION, self.model, self.adapter, self.kv]).encode()
        ).digest()


# partial blocks kept under one parent, the least recently used dropped first. Every prompt
# shorter than a block hangs under the namespace's root, and each finished row adds two (its
# prompt's and its whole sequence's): with 8, a burst of eight code prompts and their answers
# pushed out the short prompts' own tails, and the burst after it read them cold
TAILS_PER_PARENT = 64


def tail_key(parent: str, tail: Sequence[int]) -> str:
    """The key of a partial block after the block `parent` (or the namespace seed, in hex);
    prefixed "t" so it can never be taken for a full block."""
    chunk = np.asarray(tail, dtype=np.int64).tobytes()
    return "t" + hashlib.sha256(bytes.fromhex(parent) + b"tail" + chunk).hexdigest()


def shared_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` have in common (tokens, or characters)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def attachment_key(key: str, draft: str) -> str:
    """The key of the draft state (revision `draft`) stored beside the block `key`; a partial
    block's attachment starts with "t" as the block does (RAM only, like it)."""
    digest = hashlib.sha256(f"{key}/{draft}".encode()).hexdigest()
    return ("ta" if key.startswith("t") else "a") + digest


def block_keys(tokens: Sequence[int], ns: Namespace, block: int) -> list[str]:
    """Chained keys of every full block of `tokens`."""
    keys: list[str] = []
    parent = ns.seed
    full = len(tokens) // block * block
    data = np.asarray(tokens[:full], dtype=np.int64).tobytes()  # one conversion, not per block
    step = block * 8
    for start in range(0, len(data), step):
        parent = hashlib.sha256(parent + data[start : start + step]).digest()
        keys.append(parent.hex())
    return keys


# -- one block: every layer's slice of K/V -----------------------------------------------------


class Held:
    """The memory a run's views keep alive: a copy of the run's range, or a finished row's
    cache buffers whole (their padding and the tokens past the range included), shared by
    every run viewing them (a row's prompt and its whole sequence). The RAM tier counts it
    once, while any block viewing it is in RAM, not the views' own bytes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.blocks = 0  # blocks in RAM viewing it
        self.runs: list[Run] = []  # the runs viewing it
        self.total = 0  # their blocks


HELD_MARK = "_mlxd_held"  # on a finished row's first cache layer: (its buffers, their Held)


def _held_by(caches: Sequence[Any], buffers: list[mx.array]) -> Held:
    """The Held of a finished row's cache `buffers`, one for every run offered from them."""
    mark = getattr(caches[0], HELD_MARK, None)
    if (
        mark is not None
        and len(mark[0]) == len(buffers)
        and all(a is b for a, b in zip(mark[0], buffers, strict=True))
    ):
        return mark[1]
    held = Held(sum(a.nbytes for a in buffers))
    setattr(caches[0], HELD_MARK, (buffers, held))
    return held


class Run:
    """The K/V of consecutive blocks, offered together: its blocks are views of it. Each
    array is laid out as the caches' own, (..., tokens, dim), so a restore of the run's
    blocks in order reads one slice per layer (at 7k tokens, 64 kernels against 7,000) and
    copies it once, into the new cache. A live row's run is one copy of each layer's range
    (its cache keeps growing: a view would stop MLX updating it in place); a finished row's
    run is a view of its cache itself, copied by nothing. `keys` are the run's blocks still
    in RAM; once half of them are gone the survivors take their own copies
    (`RamTier._left_run`), so a few hot blocks never hold a large run alive."""

    def __init__(
        self, arrays: list[list[mx.array]], blocks: int, block: int, held: Held | None = None
    ) -> None:
        self.arrays = arrays
        self.blocks = blocks
        self.block = block  # tokens per block
        self.keys: set[str] = set()
        # what its views keep alive: by default its own arrays (a copy of the range)
        self.held = held or Held(sum(a.nbytes for layer in arrays for a in layer))
        self.held.runs.append(self)
        self.held.total += blocks

    def span(self, layer: int, i: int, first: int, last: int) -> mx.array:
        """Blocks first..last of array i of a layer."""
        return self.arrays[layer][i][..., first * self.block : (last + 1) * self.block, :]


@dataclass
class Block:
    """Per layer, a kind ("kv" or "q<bits>/<group>") and its arrays sliced to the block;
    `run` and `index` say where the arrays lie when they are views of a `Run`."""

    kinds: list[str]
    arrays: list[list[mx.array]]
    run: Run | None = None
    index: int = 0  # its place in the run
    # counted once: a 7k-token restore of a 32-layer model asks for them about 300 times,
    # which summed over the arrays took 1.5 of its 2.5 ms of host time
    nbytes: int = field(init=False)
    tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(a.nbytes for layer in self.arrays for a in layer)
        self.tokens = int(self.arrays[0][0].shape[-2])

    def follows(self, other: Block) -> bool:
        """Whether this block's arrays continue `other`'s in one run."""
        return self.run is not None and self.run is other.run and self.index == other.index + 1

    def detached(self) -> Block:
        """The block with arrays of its own (evaluated), outside any run."""
        arrays = [[_copy(a) for a in layer] for layer in self.arrays]
        mx.eval(arrays)
        return Block(self.kinds, arrays)


def _copy(x: mx.array) -> mx.array:
    # A fresh buffer: a slice would keep the whole cache buffer alive.
    return x * 1


def _layer_parts(c: Any) -> tuple[str, list[mx.array]] | None:
    """A cache layer's kind and the arrays whose -2 axis is tokens; None for other kinds."""
    if isinstance(c, QuantizedKVCache) and c.keys is not None and c.values is not None:
        return f"q{c.bits}/{c.group_size}", [*c.keys, *c.values]
    if isinstance(c, KVCache) and c.keys is not None and c.values is not None:
        return "kv", [c.keys, c.values]
    return None


def slice_layers(caches: Sequence[Any], start: int, end: int) -> Block | None:
    """The block [start, end) of each layer (a copy), or None for caches it cannot slice."""
    runs = slice_run(caches, start, end, end - start)
    return runs[0] if runs else None


def slice_run(
    caches: Sequence[Any], start: int, end: int, block: int, finished: bool = False
) -> list[Block] | None:
    """The blocks of `block` tokens covering [start, end), as views of one `Run` of each
    layer's range: a copy of it, or, for the caches of a `finished` row (never written
    again), the range itself where it fills at least half of their buffers. One block alone
    is a copy of its own. None for caches it cannot slice."""
    count = max(1, (end - start) // block)
    if count > 1 and count * block != end - start:
        raise ValueError("a run covers whole blocks")
    kinds: list[str] = []
    arrays: list[list[mx.array]] = []
    buffers: list[mx.array] = []
    first = _layer_parts(caches[0]) if caches else None
    # a view keeps the whole buffer: where the range is under half of it (a short row in a
    # GPU's 1,024-token bucket), a copy holds less
    viewed = (
        finished and count > 1 and first is not None and 2 * (end - start) >= first[1][0].shape[-2]
    )
    for c in caches:
        found = _layer_parts(c)
        if found is None:
            return None
        kinds.append(found[0])
        ranges = [p[..., start:end, :] for p in found[1]]
        arrays.append(ranges if viewed else [_copy(r) for r in ranges])
        buffers += found[1]
    if count == 1:
        mx.eval(arrays)
        return [Block(kinds, arrays)]
    run = Run(arrays, count, block, _held_by(caches, buffers) if viewed else None)
    views = [[[run.span(n, i, b, b) for i in range(len(layer))] for n, layer in enumerate(arrays)]
             for b in range(count)]  # fmt: skip
    mx.eval(arrays, views)  # once: an evaluation per block syncs per block (GPU: ~1 ms each)
    return [Block(kinds, views[b], run, b) for b in range(count)]


def build_caches(
    blocks: Sequence[Block], layer_from: int, layer_to: int, bucket: int | None
) -> list[Any]:
    """Caches for layers [layer_from, layer_to) holding the concatenated blocks, laid out as
    the model's own (`kvcache.bucket_of`). Blocks that continue one run are read as one slice
    of it."""
    spans: list[tuple[Block, Block]] = []  # (first, last) of consecutive blocks of one run
    for b in blocks:
        if spans and b.follows(spans[-1][1]):
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((b, b))
    caches: list[Any] = []
    for layer in range(layer_from, layer_to):
        kinds = {b.kinds[layer] for b in blocks}
        width = len(blocks[0].arrays[layer])
        parts = [
            _concat([_span(first, last, layer, i) for first, last in spans]) for i in range(width)
        ]
        tokens = int(parts[0].shape[2])
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        if kind == "kv":
            cache: Any = new_kv_cache(bucket)
            cache.update_and_fetch(parts[0], parts[1])
        elif kind.startswith("q"):
            bits, group = (int(x) for x in kind[1:].split("/"))
            cache = QuantizedKVCache(group_size=group, bits=bits)
            half = len(parts) // 2
            cache.keys, cache.values = tuple(parts[:half]), tuple(parts[half:])
            cache.offset = tokens
        else:
            raise ValueError("blocks of one layer disagree on their representation")
        caches.append(cache)
    return caches


def _span(first: Block, last: Block, layer: int, i: int) -> mx.array:
    if first is last or first.run is None:
        return first.arrays[layer][i]
    return first.run.span(layer, i, first.index, last.index)


def _concat(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


# -- SSD encoding: header, raw bytes, checksum ------------------------------------------------


_DTYPES = {  # what an entry's arrays are read back as
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,  # stored as its raw 16-bit pattern
    "uint32": np.uint32,
}


def encode(key: str, block: Block) -> bytes:
    return encoded(key, block).join()


def encoded(key: str, block: Block) -> Parts:
    """The entry as its parts: magic and lengths, header, then every array's raw bytes.

    The arrays are first copied into one fresh buffer (one kernel), and only that copy is
    read from the host: on MLX's CUDA build a host read moves an array's buffer into
    unified memory for good, and the block's own arrays, still in the RAM tier, would then
    be paged back into the GPU by every restore. The host then sees the copy as it is: no
    conversion, no join (`Parts` are written one after another)."""
    metas: list[list[list[Any]]] = []
    flat: list[mx.array] = []
    for layer in block.arrays:
        metas.append([])
        for a in layer:
            metas[-1].append([str(a.dtype).removeprefix("mlx.core."), list(a.shape)])
            flat.append(a.reshape(-1).view(mx.uint8))
    body = mx.concatenate(flat) if len(flat) > 1 else flat[0] + 0  # a copy either way
    mx.eval(body)
    payload = memoryview(body)  # type: ignore[arg-type]  # MLX exports a buffer: no copy
    header = json.dumps(
        {"v": FORMAT_VERSION, "key": key, "kinds": block.kinds, "arrays": metas}
    ).encode()
    crc = crc32c(payload, crc32c(header))
    lengths = struct.pack("<IQI", len(header), payload.nbytes, crc)
    return Parts((memoryview(MAGIC + lengths + header), payload))


Parsed = tuple[list[str], list[list[tuple[str, np.ndarray]]]]  # kinds; per layer (dtype, array)


def parse(key: str, data: bytes) -> Parsed | None:
    """Check and parse an entry without MLX (reader threads run this): numpy views of its
    arrays, or None for anything truncated, corrupted, foreign or of another version."""
    try:
        if not data.startswith(MAGIC):
            return None
        hlen, blen, crc = struct.unpack_from("<IQI", data, len(MAGIC))
        start = len(MAGIC) + struct.calcsize("<IQI")
        view = memoryview(data)  # slices of a view copy nothing: a block is megabytes
        header, body = bytes(view[start : start + hlen]), view[start + hlen :]
        if len(body) != blen or crc32c(body, crc32c(header)) != crc:
            return None
        meta = json.loads(header)
        if not isinstance(meta, dict) or meta.get("v") != FORMAT_VERSION or meta.get("key") != key:
            return None
        layers: list[list[tuple[str, np.ndarray]]] = []
        pos = 0
        for layer in meta["arrays"]:
            layers.append([])
            for dtype, shape in layer:
                np_dtype = _DTYPES[dtype]
                count = int(np.prod(shape))
                raw = np.frombuffer(body, dtype=np_dtype, count=count, offset=pos).reshape(shape)
                pos += raw.nbytes
                layers[-1].append((dtype, raw))
        return list(meta["kinds"]), layers
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error):
        return None


Loaded = tuple[list[str], list[list[tuple[str, mx.array]]]]  # as Parsed, in MLX memory


def load(parsed: Parsed) -> Loaded:
    """The parsed arrays copied into MLX memory, as stored (bfloat16 as its 16-bit pattern).
    No operation runs, so a reader thread may do it beside its file reads: MLX operations
    stay on the caller's streams."""
    kinds, layers = parsed
    return kinds, [[(dtype, mx.array(raw)) for dtype, raw in layer] for layer in layers]


def to_block(loaded: Loaded) -> Block:
    """The block of loaded arrays (on the calling thread: a bfloat16 view is an operation)."""
    kinds, layers = loaded
    return Block(
        kinds,
        [
            [a.view(mx.bfloat16) if dtype == "bfloat16" else a for dtype, a in layer]
            for layer in layers
        ],
    )


def decode(key: str, data: bytes) -> Block | None:
    """The block, or None for anything truncated, corrupted, foreign or of another version."""
    parsed = parse(key, data)
    return None if parsed is None else to_block(load(parsed))


# -- tiers -------------------------------------------------------------------------------------


RAM, SSD, TAIL = "ram", "ssd", "tail"  # where a found block came from (a tail: RAM, partial)


class Found(list[tuple[str, Block]]):
    """What a lookup found, (key, block) by position, and the tier each came from: counted as
    hits per tier only once the caller restores them (`PrefixCache.used`)."""

    def __init__(self) -> None:
        super().__init__()
        self.tiers: list[str] = []

    def add(self, key: str, block: Block, tier: str) -> None:
        self.append((key, block))
        self.tiers.append(tier)

    def first(self, n: int) -> Found:
        """The first `n` (what every rank of a sharded model holds)."""
        out = Found()
        for (key, block), tier in zip(self[:n], self.tiers[:n], strict=True):
            out.add(key, block, tier)
        return out


class RamTier:
    """LRU by bytes: the bytes its blocks keep alive (a run's `Held` once, however many of
    its blocks are in), so the budget bounds the memory, not the views' sizes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[str, Block] = OrderedDict()
        self.nbytes = 0

    def get(self, key: str) -> Block | None:
        block = self.entries.get(key)
        if block is not None:
            self.entries.move_to_end(key)
        return block

    def put(self, key: str, block: Block) -> list[tuple[str, Block]]:
        """Store; returns what had to be evicted to stay within the budget."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        if block.nbytes > self.budget:
            return [(key, block)]
        self.entries[key] = block
        self._enter(block)
        if block.run is not None:
            block.run.keys.add(key)
        evicted = []
        while self.nbytes > self.budget and self.entries:
            old_key, old = self.entries.popitem(last=False)
            self._leave(old)
            self._left_run(old_key, old)
            evicted.append((old_key, old))
        return evicted

    def drop(self, key: str) -> None:
        block = self.entries.pop(key, None)
        if block is not None:
            self._leave(block)
            self._left_run(key, block)

    def _enter(self, block: Block) -> None:
        held = block.run.held if block.run is not None else None
        if held is None:
            self.nbytes += block.nbytes
        else:
            held.blocks += 1
            self.nbytes += held.nbytes if held.blocks == 1 else 0

    def _leave(self, block: Block) -> None:
        held = block.run.held if block.run is not None else None
        if held is None:
            self.nbytes -= block.nbytes
        else:
            held.blocks -= 1
            self.nbytes -= held.nbytes if held.blocks == 0 else 0

    def _left_run(self, key: str, block: Block) -> None:
        """A block of a run left RAM: once at most half the blocks viewing its memory are
        left (its run's and those of runs sharing its buffers), the survivors take copies of
        their own and that memory goes with its last view."""
        run = block.run
        if run is None:
            return
        run.keys.discard(key)
        held = run.held
        if not held.blocks or 2 * held.blocks > held.total:
            return
        for survivor in held.runs:
            for k in survivor.keys:
                if k in self.entries:
                    self._leave(self.entries[k])
                    self.entries[k] = self.entries[k].detached()
                    self._enter(self.entries[k])
            survivor.keys.clear()
        held.runs.clear()


READERS = min(8, os.cpu_count() or 1)  # parallel block reads: files and checksums run GIL-free
PROBE_BYTES = 32 << 20
WRITE_PAUSE_S = 60.0  # after a failed SSD write (a full disk), the writes dropped meanwhile


def probe_read_rate(directory: Path, readers: ThreadPoolExecutor) -> float:
    """Bytes per second this directory gives back, read and checksummed as blocks are: files
    written, dropped from the page cache where the OS allows, read back in parallel. 0 when
    it cannot be measured (every SSD hit is then used, as without a measure)."""
    part = PROBE_BYTES // READERS
    paths = [directory / f"read-probe-{os.getpid()}-{i}.tmp" for i in range(READERS)]

    def read(path: Path) -> int:
        data = path.read_bytes()
        crc32c(data)
        return len(data)

    for stale in directory.glob("read-probe-*-*.tmp"):  # left by a process that was killed
        writer = stale.name.split("-")[2]  # (another daemon sharing the home keeps its own)
        if writer.isdigit() and not writer_running(int(writer)):
            with contextlib.suppress(OSError):
                stale.unlink()
    try:
        payload = os.urandom(part)
        for path in paths:
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        total = sum(readers.map(read, paths))
        return total / max(time.perf_counter() - t0, 1e-6)
    except OSError as exc:
        log.warning("prefix cache: could not measure the SSD's read rate: %s", exc)
        return 0.0
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()


class SsdTier:
    """diskcache on a directory, LRU and size-bounded, written behind by one thread.

    Writes queue without bound in count but within `max_pending_bytes`: decoding never waits
    on the disk, and only a backlog larger than that drops blocks (counted in `dropped`).
    Raises `StoreUnavailable` for a directory it cannot use.
    """

    def __init__(
        self, directory: Path, size_limit: int, max_pending_bytes: int = 4 * 2**30
    ) -> None:
        self._store = open_store(directory, size_limit)
        self.cache = self._store.cache
        self.reclaimed: Reclaimed = self._store.reclaimed
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[str, Block] | None] = queue.Queue()
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._work = start_mlx_thread(self._write_loop, "kvcache-writer")
        self.dropped = 0
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvcache-reader")
        self.read_rate = probe_read_rate(Path(self.cache.directory), self._readers)

    def put_async(self, key: str, block: Block) -> None:
        with self._lock:
            if key in self._pending:
                return
            if self._pending_bytes + block.nbytes > self.max_pending_bytes:
                self.dropped += 1  # the disk is far behind: drop rather than hold memory
                return
            self._pending.add(key)
            self._pending_bytes += block.nbytes
        self._queue.put_nowait((key, block))

    def _write_loop(self) -> None:
        paused_until = 0.0  # a failed write (a full disk) pauses writing: one warning, no flood
        while (item := self._queue.get()) is not None:
            key, block = item
            try:
                if time.monotonic() < paused_until:
                    with self._lock:
                        self.dropped += 1
                elif key not in self.cache:
                    self.cache.set(key, encoded(key, block))
            except Exception as exc:
                paused_until = time.monotonic() + WRITE_PAUSE_S
                with self._lock:
                    self.dropped += 1
                if isinstance(exc, OSError | sqlite3.Error):
                    log.warning(
                        "prefix cache: an SSD write failed (%s): writes pause for %.0f s, the"
                        " RAM tier serves meanwhile", getattr(exc, "strerror", None) or exc,
                        WRITE_PAUSE_S,
                    )  # fmt: skip
                else:
                    log.exception("prefix cache: SSD write failed")
            finally:
                with self._lock:
                    self._pending.discard(key)
                    self._pending_bytes -= block.nbytes
                self._queue.task_done()

    def _read(self, key: str) -> Loaded | None:
        """One entry, read, checked and copied into MLX memory (on a reader thread); a bad
        one is deleted."""
        try:
            data = self.cache.get(key)
        except BadEntry as exc:
            log.warning("prefix cache: dropping an SSD entry: %s", exc)
            data = b""  # deleted below: its file (if it is one of ours) goes too
        except Exception:
            log.exception("prefix cache: SSD read failed")
            return None
        if data is None:
            return None
        parsed = parse(key, data) if isinstance(data, bytes) else None
        if parsed is None:
            with contextlib.suppress(Exception):
                self.cache.delete(key)
            return None
        return load(parsed)

    def get(self, key: str) -> Block | None:
        found = self.get_run([key])
        return found[0] if found else None

    def get_run(self, keys: Sequence[str]) -> list[Block]:
        """The leading entries of `keys` that are stored, read in parallel (files, checksums,
        copies into MLX memory) and measured: their rate feeds `read_rate`."""
        if not keys:
            return []
        t0 = time.perf_counter()
        futures = [self._readers.submit(self._read, key) for key in keys]
        found: list[Block] = []
        for future in futures:
            loaded = future.result()
            if loaded is None:
                break
            found.append(to_block(loaded))
        for future in futures[len(found) :]:
            future.cancel()  # past the first miss: not needed (a running read just ends)
        nbytes = sum(b.nbytes for b in found)
        if nbytes >= 1 << 20:  # small reads measure per-file overhead, not the disk
            seen = nbytes / max(time.perf_counter() - t0, 1e-6)
            self.read_rate = 0.7 * self.read_rate + 0.3 * seen if self.read_rate else seen
        return found

    def flush(self) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._work.join(10)
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._store.close()

    @property
    def nbytes(self) -> int:
        try:
            return int(self.cache.volume()) + self.reclaimed.orphan_bytes_left
        except Exception:
            return 0

    def backlog(self) -> tuple[int, int]:
        """(blocks, bytes) queued for the disk and not written yet."""
        with self._lock:
            return len(self._pending), self._pending_bytes


@dataclass
class CacheStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    ram_hit_blocks: int = 0
    ssd_hit_blocks: int = 0
    ram_hit_bytes: int = 0  # restored from RAM (a partial block counts here)
    ssd_hit_bytes: int = 0  # read back from SSD
    restored_bytes: int = 0
    inserted_blocks: int = 0
    ssd_skipped_lookups: int = 0  # lookups that recomputed rather than read the slower SSD


class PrefixCache:
    """The facade the runners use: `lookup` before prefill, `insert` after."""

    def __init__(
        self,
        ram_bytes: int,
        ssd_dir: Path | None = None,
        ssd_bytes: int = 0,
        block: int = DEFAULT_BLOCK,
    ) -> None:
        self.block = block
        self.ram = RamTier(ram_bytes)
        self.ssd: SsdTier | None = None
        self.ssd_off = "" if ssd_dir is not None and ssd_bytes > 0 else "not configured"
        if not self.ssd_off:
            assert ssd_dir is not None
            try:
                self.ssd = SsdTier(ssd_dir, ssd_bytes)
            except (StoreUnavailable, OSError, sqlite3.Error) as exc:
                self.ssd_off = str(exc) or type(exc).__name__
                log.warning("prefix cache: SSD tier off, RAM only: %s", self.ssd_off)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        # parent key -> {partial block's tokens: its key}, most recent last; and back
        self._tails: dict[str, OrderedDict[tuple[int, ...], str]] = {}
        self._tail_of: dict[str, tuple[str, tuple[int, ...]]] = {}
        # parent key -> {full block's tokens: its key}, most recent last: what a prompt that
        # diverges inside a block reuses the common part of (`_longest_common`)
        self._children: dict[str, OrderedDict[tuple[int, ...], str]] = {}
        # the fewest shared tokens worth a restore: a handful (every prompt's first token) are
        # cheaper to read again than to restore
        self.min_shared = max(1, self.block // 4)
        self._child_of: dict[str, tuple[str, tuple[int, ...]]] = {}

    def lookup(
        self, ns: Namespace, tokens: Sequence[int], recompute_rate: float = 0.0
    ) -> list[Block]:
        """The longest run of cached blocks that prefixes `tokens`, ending with the longest
        cached partial block that continues it; counted as used."""
        found = self.lookup_keyed(ns, tokens, recompute_rate)
        self.used(found)
        return [block for _, block in found]

    def used(self, found: Found) -> None:
        """Count a hit its caller restores (`hit_tokens`, `restored_bytes`, the blocks and
        bytes of each tier): one it refuses (a quantizing row's partial head, an unusable
        entry) is no hit."""
        s = self.stats
        with self._lock:
            for (_, block), tier in zip(found, found.tiers, strict=True):
                s.hit_tokens += block.tokens
                s.restored_bytes += block.nbytes
                if tier == SSD:
                    s.ssd_hit_blocks += 1
                    s.ssd_hit_bytes += block.nbytes
                else:
                    s.ram_hit_blocks += tier == RAM  # a partial block counts its bytes only
                    s.ram_hit_bytes += block.nbytes

    def ssd_pays(self, recompute_rate: float) -> bool:
        """Whether reading K/V back from the SSD beats recomputing it: `recompute_rate` is the
        bytes of K/V per second the model's prefill produces on this device (0: unknown),
        against the rate this disk has been measured to give back. On a fast GPU prefill
        can outrun the disk; on a Mac it rarely does."""
        if self.ssd is None:
            return False
        rate = self.ssd.read_rate
        return recompute_rate <= 0 or rate <= 0 or rate > recompute_rate

    def lookup_keyed(
        self, ns: Namespace, tokens: Sequence[int], recompute_rate: float = 0.0
    ) -> Found:
        """`lookup`, with each block's key (for its attachments), not yet counted as a hit
        (`used`). SSD blocks are used only where reading them beats recomputing them
        (`ssd_pays`); runs of them are read in parallel."""
        found = Found()
        keys = block_keys(tokens, ns, self.block)
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(tokens)
            use_ssd = self.ssd_pays(recompute_rate)
            if self.ssd is not None and not use_ssd:
                self.stats.ssd_skipped_lookups += 1
            i = 0
            while i < len(keys):
                block = self.ram.get(keys[i])
                if block is not None:
                    found.add(keys[i], block, RAM)
                    i += 1
                    continue
                if not use_ssd or self.ssd is None:
                    break
                end = next(
                    (j for j in range(i, len(keys)) if keys[j] in self.ram.entries), len(keys)
                )
                run = self.ssd.get_run(keys[i:end])
                for key, block in zip(keys[i:end], run, strict=False):
                    self._spill(self.ram.put(key, block))
                    found.add(key, block, SSD)
                if len(run) < end - i:
                    break
                i = end
            parent = keys[len(found) - 1] if found else ns.seed.hex()
            rest = tokens[len(found) * self.block :]
            tail = self._longest_tail(parent, rest)  # whole: its draft attachment comes along
            common = self._longest_common(parent, rest)
            if common is not None and (tail is None or common[1].tokens > tail[1].tokens):
                tail = common
            if tail is not None:
                found.add(*tail, TAIL)
        return found

    def attachments(
        self, keys: Sequence[str], draft: str, recompute_rate: float = 0.0
    ) -> list[Block]:
        """The draft's state for the leading blocks `keys` that have it (stops at the first
        block without). Its bytes count as restored, per tier, as the blocks' do."""
        found: list[Block] = []
        with self._lock:
            use_ssd = self.ssd_pays(recompute_rate)
            for key in map(attachment_key, keys, [draft] * len(keys)):
                block = self.ram.get(key)
                if block is not None:
                    self.stats.ram_hit_bytes += block.nbytes
                elif self.ssd is not None and use_ssd and not key.startswith("t"):
                    block = self.ssd.get(key)
                    if block is not None:
                        self.stats.ssd_hit_bytes += block.nbytes
                        self._spill(self.ram.put(key, block))
                if block is None:
                    break
                found.append(block)
            self.stats.restored_bytes += sum(b.nbytes for b in found)
        return found

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self.ram.entries

    def has_attachment(self, key: str, draft: str) -> bool:
        return self.has(attachment_key(key, draft))

    def _longest_tail(self, parent: str, rest: Sequence[int]) -> tuple[str, Block] | None:
        """The longest partial block under `parent` that `rest` begins with, now the most
        recently used of its parent's."""
        best: tuple[str, Block] | None = None
        found: tuple[int, ...] = ()
        for tail, key in list(self._tails.get(parent, {}).items()):
            if len(tail) > len(rest) or (best is not None and len(tail) <= best[1].tokens):
                continue
            if tuple(rest[: len(tail)]) == tail:
                block = self.ram.get(key)
                if block is None:
                    self._forget_tail(key)
                else:
                    best, found = (key, block), tail
        if best is not None:
            self._tails[parent].move_to_end(found)
        return best

    def _longest_common(self, parent: str, rest: Sequence[int]) -> tuple[str, Block] | None:
        """The first tokens of a block cached under `parent` (full or partial) that `rest`
        shares, where it diverges inside them (a keystroke in the middle of an editor's
        prompt, a shortened one, another question after a shared system prompt): K/V at a
        position depend only on the tokens up to it, so the shared part is the block's first
        rows. Its key names no block (no attachment: the draft reads these tokens itself)."""
        best: tuple[int, str] | None = None
        head = rest[: self.block]
        for index in (self._children.get(parent), self._tails.get(parent)):
            for tokens, key in (index or {}).items():
                shared = shared_prefix(tokens, head)
                if shared < self.min_shared or (best is not None and shared <= best[0]):
                    continue
                if key in self.ram.entries:
                    best = (shared, key)
        if best is None:
            return None
        shared, key = best
        block = self.ram.get(key)
        if block is None:
            return None
        rows = [[a[..., :shared, :] for a in layer] for layer in block.arrays]
        return f"t{key}:{shared}", Block(block.kinds, rows)

    def tail(self, ns: Namespace, tokens: Sequence[int]) -> tuple[str, str] | None:
        """(parent, key) of the partial block that ends `tokens`, unless they end on a block
        boundary or it is cached already."""
        found = self.tail_of(ns, tokens)
        return None if found is None or self.has(found[1]) else found

    def tail_of(self, ns: Namespace, tokens: Sequence[int]) -> tuple[str, str] | None:
        """(parent, key) of the partial block that ends `tokens`, unless they end on a block
        boundary."""
        full = len(tokens) // self.block
        if full * self.block == len(tokens):
            return None
        keys = block_keys(tokens[: full * self.block], ns, self.block)
        parent = keys[-1] if keys else ns.seed.hex()
        return parent, tail_key(parent, tokens[full * self.block :])

    def block_keys(self, ns: Namespace, tokens: Sequence[int]) -> list[str]:
        return block_keys(tokens, ns, self.block)

    def insert_tail(self, parent: str, tail: Sequence[int], key: str, block: Block) -> None:
        """Keep a partial block in RAM (it is superseded too often to be worth the disk)."""
        mx.eval([a for layer in block.arrays for a in layer])
        with self._lock:
            self.stats.inserted_blocks += 1
            self._spill(self.ram.put(key, block))
            if key not in self.ram.entries:
                return  # larger than the whole budget
            tails = self._tails.setdefault(parent, OrderedDict())
            tails[tuple(tail)] = key
            self._tail_of[key] = (parent, tuple(tail))
            while len(tails) > TAILS_PER_PARENT:
                _, old = tails.popitem(last=False)
                self._tail_of.pop(old, None)
                self.ram.drop(old)

    def _forget_tail(self, key: str) -> None:
        parent, tail = self._tail_of.pop(key, ("", ()))
        tails = self._tails.get(parent)
        if tails is not None:
            tails.pop(tail, None)
            if not tails:
                del self._tails[parent]

    def attach(self, key: str, draft: str, block: Block, through: bool = True) -> None:
        """Store the draft's state beside the block `key` (a partial block's: in RAM only)."""
        akey = attachment_key(key, draft)
        if not akey.startswith("t"):
            self.insert(akey, block, through)
            return
        mx.eval([a for layer in block.arrays for a in layer])
        with self._lock:
            self.stats.inserted_blocks += 1
            self._spill(self.ram.put(akey, block))

    def missing(self, ns: Namespace, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """(block index, key) of the full blocks of `tokens` not yet in RAM."""
        keys = block_keys(tokens, ns, self.block)
        with self._lock:
            return [(i, k) for i, k in enumerate(keys) if k not in self.ram.entries]

    def insert(
        self,
        key: str,
        block: Block,
        through: bool = True,
        under: tuple[str, Sequence[int]] | None = None,
    ) -> None:
        """Keep a block in RAM and, with `through`, write it to SSD too (behind the decode
        path); without, it reaches the SSD only when RAM evicts it or at shutdown. `under`:
        its parent's key and its tokens, which a prompt diverging inside it reuses the shared
        part of (`_longest_common`)."""
        mx.eval([a for layer in block.arrays for a in layer])
        with self._lock:
            self.stats.inserted_blocks += 1
            self._spill(self.ram.put(key, block))
            if under is not None and key in self.ram.entries:
                parent, tokens = under[0], tuple(under[1])
                children = self._children.setdefault(parent, OrderedDict())
                children[tokens] = key
                self._child_of[key] = (parent, tokens)
                while len(children) > TAILS_PER_PARENT:
                    _, old = children.popitem(last=False)
                    self._child_of.pop(old, None)
        if self.ssd is not None and through:
            self.ssd.put_async(key, block)

    def _spill(self, evicted: list[tuple[str, Block]]) -> None:
        for key, block in evicted:
            if key.startswith("t"):
                self._forget_tail(key)
                continue
            self._forget_child(key)
            if self.ssd is not None:
                self.ssd.put_async(key, block)

    def _forget_child(self, key: str) -> None:
        parent, tokens = self._child_of.pop(key, ("", ()))
        children = self._children.get(parent)
        if children is not None and children.get(tokens) == key:
            del children[tokens]
            if not children:
                del self._children[parent]

    def persist(self) -> None:
        """Write everything still only in RAM to SSD (shutdown), then wait for the writer."""
        if self.ssd is None:
            return
        with self._lock:
            items = [(k, b) for k, b in self.ram.entries.items() if not k.startswith("t")]
        for key, block in items:
            self.ssd.put_async(key, block)
        self.ssd.flush()

    def close(self) -> None:
        if self.ssd is not None:
            self.persist()
            self.ssd.close()

    def _reclaimed(self) -> dict[str, Any]:
        r = self.ssd.reclaimed if self.ssd is not None else Reclaimed()
        return {
            "ssd_damaged_db": r.damaged,
            "ssd_foreign_rows_dropped": r.rows_dropped,
            "ssd_orphans_reclaimed": r.orphans,
            "ssd_orphan_bytes_reclaimed": r.orphan_bytes,
            "ssd_orphan_bytes": r.orphan_bytes_left,
        }

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "block_tokens": self.block,
            "ram_bytes": self.ram.nbytes,
            "ram_budget": self.ram.budget,
            "ram_blocks": len(self.ram.entries),
            "ssd": "on" if self.ssd is not None else f"off: {self.ssd_off}",
            "ssd_bytes": self.ssd.nbytes if self.ssd is not None else 0,
            "ssd_dropped_writes": self.ssd.dropped if self.ssd is not None else 0,
            "ssd_read_rate": round(self.ssd.read_rate) if self.ssd is not None else 0,
            "ssd_skipped_lookups": self.stats.ssd_skipped_lookups,
            **self._reclaimed(),
            "lookups": s.lookups,
            "lookup_tokens": s.lookup_tokens,
            "hit_tokens": s.hit_tokens,
            "hit_rate": round(s.hit_tokens / s.lookup_tokens, 4) if s.lookup_tokens else 0.0,
            "ram_hit_blocks": s.ram_hit_blocks,
            "ssd_hit_blocks": s.ssd_hit_blocks,
            "restored_bytes": s.restored_bytes,
            "inserted_blocks": s.inserted_blocks,
        }
