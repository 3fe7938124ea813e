"""Which pairings are loaded: load on demand (an entry with adapters mounts them on a loaded
base of the same `ModelEntry.load_key`, whichever entry loaded it, and loads one shared base
only when there is none; a plain entry keeps its own, or uses a shared base already there), keep_alive expiry, a cap on loaded models, a memory
budget checked before every load, a bounded count of requests waiting to run, and a watchdog
that reloads a pairing whose runner stopped making progress.

Everything here runs on the event loop except `Ticket.start`, which a runner thread may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx

from mlxd.engine.adapters import DEFAULT_ADAPTER_BYTES, AdapterError, check_entry_adapters
from mlxd.engine.backend import Backend
from mlxd.engine.counts import EVICTION, LOAD, LOAD_FAILURE, RUNNER_RESTART, LifecycleCounts
from mlxd.engine.distributed.group import forget_loss, lost_reason
from mlxd.engine.embedding.model import (
    Embedded,
    EmbedRequest,
    NotAnEmbeddingModel,
    load_embedder,
)
from mlxd.engine.embedding.runner import EmbeddingRunner
from mlxd.engine.embedding.spec import EmbeddingSpec, embedding_spec
from mlxd.engine.events import Done, Event, Failed, GenerationRequest
from mlxd.engine.memory import (
    Budget,
    MemoryNeed,
    estimate,
    estimate_embedding,
    human_bytes,
    resolve_budget,
)
from mlxd.engine.options import OptionsError, parse_options
from mlxd.engine.pairing import (
    ModelNotPulled,
    ModelUnavailable,
    Pairing,
    close_target,
    load_pairing,
    locate,
)
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.probestore import ProbeStore
from mlxd.engine.runner import PairingRunner
from mlxd.engine.speculation import Costs
from mlxd.engine.threads import run_in_mlx_thread
from mlxd.registry.schema import ModelEntry
from mlxd.registry.store import files_present, resolve_adapter, resolve_local

log = logging.getLogger(__name__)

# Told how each request ended: the model's name and its final event (on the event loop).
FinishObserver = Callable[[str, Done | Failed], None]

FOREVER = float("inf")
DEFAULT_MAX_QUEUE = 512
DEFAULT_NUM_PARALLEL = 4
JOIN_TIMEOUT = 60.0  # seconds to wait for a stopped runner's thread to let go of its memory
DEFAULT_STALL_LIMIT = 120.0  # seconds a runner may hold requests without finishing a step
PROBE_SHUTDOWN_WAIT = 120.0  # seconds shutdown waits for a probe in progress
QUEUE_FULL = "server busy, please try again.  maximum pending requests exceeded"


class QueueFull(RuntimeError):
    """Too many requests are waiting already (Ollama answers 503)."""

    def __init__(self) -> None:
        super().__init__(QUEUE_FULL)


class ServerClosing(RuntimeError):
    """The daemon is stopping: a request waiting for a model is refused (503)."""

    def __init__(self) -> None:
        super().__init__(CLOSING)


CLOSING = "mlxd is shutting down"


class InsufficientMemory(ModelUnavailable):
    """The pairing cannot fit in the memory budget even with every other model unloaded."""


class NotAGenerativeModel(ModelUnavailable):
    """Text generation was asked of an embedding model (Ollama answers 400)."""

    def __init__(self, name: str, what: str = "generate") -> None:
        super().__init__(f'"{name}" does not support {what}')


@dataclass(frozen=True)
class ProbeResult:
    """What opening a pairing at startup (or after a registry change) found."""

    ok: bool
    reason: str | None = None
    costs: Costs | None = None
    seconds: float = 0.0
    remembered: bool = False  # read back from an earlier run's probe of the same files
    files: tuple[tuple[str, int, int], ...] = ()  # `files_stamp` when it was probed


def files_stamp(entry: ModelEntry) -> tuple[tuple[str, int, int], ...]:
    """The entry's model and adapter files as they are now (path, size, modification time):
    a failed probe is tried again once they change (a pull that repaired a damaged file, a
    file put back by hand), not only after a restart."""
    dirs = [resolve_local(ref) for ref in (entry.target, entry.draft) if ref is not None]
    refs = (*entry.adapters, *entry.draft_adapters)
    dirs += [resolve_adapter(a.ref) for a in refs]
    found: list[tuple[str, int, int]] = []
    for folder in dirs:
        if folder is None or not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            with contextlib.suppress(OSError):
                st = path.stat()  # through the hub cache's links to the blobs they name
                found.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(found)


def _check_adapters(entry: ModelEntry) -> str | None:
    """Why the entry's adapters cannot be mounted on its base (None: they can)."""
    if not entry.adapters and not entry.draft_adapters:
        return None
    try:
        target = locate(entry.target, "target")
        draft = locate(entry.draft, "draft") if entry.draft else None
        check_entry_adapters(entry.adapters, target, entry.draft_adapters, draft)
    except (AdapterError, ModelUnavailable) as exc:
        return str(exc)
    return None


def _probe_blocking(entry: ModelEntry, backend: Backend, store: ProbeStore | None) -> ProbeResult:
    """Open and check the pairing, unless a passed probe of the same files on the same backend
    and MLX is on record (then nothing is loaded or measured)."""
    t0 = time.perf_counter()
    if embedding_spec(entry) is not None:
        return _probe_embedder(entry, backend)
    if entry.distributed is not None:
        store = None  # the ranks' hosts must be reached at every start, not remembered
    try:
        key = store.key(entry, backend) if store is not None else None
    except Exception:  # unreadable files: the load below says why
        key = None
    known = store.load(key) if store is not None and key is not None else None
    if known is not None:
        return ProbeResult(True, None, known, time.perf_counter() - t0, remembered=True)
    try:
        pairing = load_pairing(entry, backend)
    except Exception as exc:
        return ProbeResult(False, str(exc) or type(exc).__name__, None, time.perf_counter() - t0)
    costs = pairing.costs
    if store is not None and key is not None:
        store.save(key, costs)
    try:
        pairing.check_options(parse_options(entry.options))
    except OptionsError as exc:  # served, but every request using these options gets a 400
        log.warning("registry entry %s: its options do not fit the model: %s", entry.name, exc)
    close_target(pairing.target)
    del pairing
    gc.collect()
    mx.clear_cache()
    return ProbeResult(True, None, costs, time.perf_counter() - t0)


def _probe_embedder(entry: ModelEntry, backend: Backend) -> ProbeResult:
    """Open an embedding model and run one forward (`load_embedder`), then let it go."""
    t0 = time.perf_counter()
    try:
        embedder = load_embedder(entry, backend)
    except Exception as exc:
        return ProbeResult(False, str(exc) or type(exc).__name__, None, time.perf_counter() - t0)
    del embedder
    gc.collect()
    mx.clear_cache()
    return ProbeResult(True, None, None, time.perf_counter() - t0)


def estimate_need(entry: ModelEntry, rows: int, backend: Backend) -> MemoryNeed:
    """What `entry` will hold once loaded (blocking: reads its files; 404-style error if absent)."""
    spec = embedding_spec(entry)
    if spec is not None:  # weights and activations: no KV cache outlives a request
        path = locate(entry.target, "model")
        limit = spec.entry_limit(entry)  # the context it reports
        return estimate_embedding(path, limit, backend.float32_compute, backend.quantized_float32)
    dirs: list[Path] = [locate(entry.target, "target")]
    if entry.draft:
        dirs.append(locate(entry.draft, "draft"))
    return estimate(dirs, entry, rows, backend.float32_compute, backend.quantized_float32)


# -- waiting requests --------------------------------------------------------------------------


class WaitCounter:
    """Requests that hold (or wait for) a model but have not started generating.

    Each request owns a Ticket and leaves the count exactly once, whichever side notices first
    (its first event, its release, or a runner thread that starts its row), so the count stays
    right however many rows a runner runs at a time.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit if limit > 0 else DEFAULT_MAX_QUEUE
        self._count = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._count

    def enter(self, counted: bool = True) -> Ticket:
        """A place in the count, or QueueFull past the limit; not `counted`: a request that
        waits for neither a model nor a row (a free row of a loaded model takes it), which
        requests arriving together must not refuse one another for."""
        with self._lock:
            if counted and self._count >= self.limit:
                raise QueueFull()
            self._count += counted
        return Ticket(self, counted)


class Ticket:
    """One request's place in the wait count."""

    def __init__(self, counter: WaitCounter, counted: bool = True) -> None:
        self._counter = counter
        self._counted = counted
        self._model: Resident | None = None
        self.waiting = True

    def attach(self, model: Resident) -> None:
        """The request now holds `model`: count it among that model's waiting requests."""
        with self._counter._lock:
            self._model = model
            if self.waiting:
                model.waiting += 1

    def start(self) -> None:
        """The request's generation began, or it gave up (idempotent; any thread)."""
        with self._counter._lock:
            if not self.waiting:
                return
            self.waiting = False
            self._counter._count -= self._counted
            if self._model is not None:
                self._model.waiting -= 1


# -- loaded pairings -------------------------------------------------------------------------


@dataclass(eq=False)
class Resident:
    """A pairing loaded (or loading) on its runner, and what keeps it there."""

    entry: ModelEntry  # the first entry it was loaded for (all of `names` share its base)
    runner: PairingRunner | EmbeddingRunner
    need: MemoryNeed
    keep_alive: float  # seconds; inf = forever, 0 = unload when idle
    users: int = 0  # requests holding it (waiting or generating)
    waiting: int = 0  # of those, the ones not generating yet
    expires_at: float = FOREVER  # monotonic; inf while in use or kept forever
    expires_wall: float | None = None  # the same moment on the wall clock (idle, not forever)
    last_used: float = field(default_factory=time.monotonic)
    retired: bool = False  # leaving: stops once idle, then its memory comes back
    stopped: bool = False  # its runner was told to stop
    abandoned: bool = False  # its runner got stuck in a step: out of service and accounts
    evicted: bool = False  # retired while busy to make room: what a waiting load waits for
    timer: asyncio.TimerHandle | None = None
    # entries served on this base, the most recently used last
    names: dict[str, None] = field(default_factory=dict)
    key: tuple[object, ...] = ()  # where the manager keeps it (`_key_for`)
    files: tuple[tuple[str, int, int], ...] = ()  # `files_stamp` of its entry when it loaded

    @property
    def loading(self) -> bool:
        return not self.runner.loaded.done()

    @property
    def active(self) -> int:
        return max(0, self.users - self.waiting)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@dataclass(eq=False)
class Loaded:
    """One request's hold on a resident pairing: what `acquire` returns and `release` ends."""

    model: Resident
    ticket: Ticket
    released: bool = False
    entry: ModelEntry | None = None  # what the request asked for (its adapters, its name)

    @property
    def name(self) -> str:
        return (self.entry or self.model.entry).name

    @property
    def runner(self) -> PairingRunner | EmbeddingRunner:
        return self.model.runner


@dataclass(frozen=True)
class ModelStatus:
    """What /api/ps and the stats endpoint report about one loaded pairing."""

    entry: ModelEntry
    need: MemoryNeed
    keep_alive: float
    expires_in: float | None  # seconds from now; None = forever
    active: int
    waiting: int
    loading: bool
    stopping: bool
    ranks: tuple[str, ...] = ()  # a distributed target's ranks (and why its group ended)
    names: tuple[str, ...] = ()  # the entries it serves now (adapter entries share a base)
    # when an idle model expires, on the wall clock, fixed from when it went idle (so every
    # listing gives the same time, as Ollama's does); None: in use, leaving, or kept forever
    expires_wall: float | None = None

    @property
    def name(self) -> str:
        """The name it is shown under (`/api/ps`, stats): the first entry it serves."""
        return self.names[0] if self.names else self.entry.name


def _served(model: Resident) -> tuple[str, ...]:
    """The entries `model` serves: the one it was loaded for first while it still does (an
    entry deleted since is served no more), else the most recently used."""
    first = (model.entry.name,) if model.entry.name in model.names else ()
    rest = tuple(n for n in reversed(model.names) if n not in first)
    return first + rest or (model.entry.name,)


def _status(model: Resident, now: float) -> ModelStatus:
    if model.retired:
        left: float | None = 0.0
    elif model.users:
        left = None if model.keep_alive == FOREVER else model.keep_alive
    else:
        left = None if model.expires_at == FOREVER else max(0.0, model.expires_at - now)
    return ModelStatus(
        entry=model.entry,
        need=model.need,
        keep_alive=model.keep_alive,
        expires_in=left,
        expires_wall=None if model.users or model.retired else model.expires_wall,
        active=model.active,
        waiting=model.waiting,
        loading=model.loading,
        stopping=model.retired or (model.users > 0 and model.keep_alive <= 0),
        ranks=_ranks(model),
        names=_served(model),
    )


def _ranks(model: Resident) -> tuple[str, ...]:
    pairing = getattr(model.runner, "pairing", None)
    describe = getattr(getattr(pairing, "target", None), "describe", None)
    return tuple(describe()) if callable(describe) else ()


def _adapted(entry: ModelEntry) -> bool:
    return bool(entry.adapters or entry.draft_adapters)


def _key_for(entry: ModelEntry) -> tuple[object, ...]:
    """A plain entry's pairing is its own (its name); adapter entries share one per base."""
    return ("base", entry.load_key) if _adapted(entry) else ("name", entry.name)


def _eviction_order(model: Resident) -> tuple[float, float]:
    """Shortest keep_alive first, then least recently used."""
    return (model.keep_alive, model.last_used)


class ModelManager:
    """Owns every PairingRunner; the API asks it for a loaded pairing and a stream of events."""

    def __init__(
        self,
        backend: Backend,
        default_keep_alive: float = 300.0,
        max_loaded: int = 3,
        prefix: PrefixCache | None = None,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        num_parallel: int = DEFAULT_NUM_PARALLEL,
        memory_budget: int | None = None,
        stall_limit: float = DEFAULT_STALL_LIMIT,
        probe_store: ProbeStore | None = None,
        lookup: Callable[[str], ModelEntry | None] | None = None,
        adapter_bytes: int | None = None,
    ) -> None:
        """`stall_limit`: seconds a runner may hold requests without finishing a step before
        its requests fail and its pairing is reloaded (0: never); `adapter_bytes`: adapters a
        loaded model keeps resident (least recently used dropped past it; None: 2 GiB)."""
        self.backend = backend  # the machine-wide choices every pairing loads with
        self.prefix = prefix  # shared by every pairing; namespaces keep them apart
        self.default_keep_alive = default_keep_alive
        self.max_loaded = max(1, max_loaded)
        self.num_parallel = max(1, num_parallel)  # rows per pairing: the KV budget, the scheduler
        self.adapter_bytes = DEFAULT_ADAPTER_BYTES if adapter_bytes is None else adapter_bytes
        self.queue = WaitCounter(max_queue)
        self.budget: Budget = resolve_budget(memory_budget)
        self._loaded: dict[tuple[object, ...], Resident] = {}  # by `_key_for` its entry
        self._retiring: list[Resident] = []  # unloaded, but still holding memory
        self._probes: dict[ModelEntry, ProbeResult] = {}
        self._pending: set[ModelEntry] = set()  # probes queued or running
        self.probe_store = probe_store  # passed probes kept across restarts
        self.lookup = lookup  # the registry's entry of a name now (None: the request's stands)
        self._closing = False  # shutting down: no further probe starts
        self._base_probes: dict[tuple[object, ...], ProbeResult] = {}  # by load key
        self._probe_lock = asyncio.Lock()
        self._load_lock = asyncio.Lock()  # one load decision at a time, as Ollama's scheduler
        self._waiters: list[asyncio.Future[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.stall_limit = stall_limit
        self.stalls = 0  # runners abandoned by the watchdog
        self._watchdog: asyncio.Task[None] | None = None
        self.counts = LifecycleCounts()  # loads, evictions, runner restarts (for /metrics)
        self.finish_observers: list[FinishObserver] = []

    # -- probe-open ----------------------------------------------------------------------------

    async def probe(self, entry: ModelEntry) -> ProbeResult | None:
        """Open and check a pairing whose files are present; None when they are not."""
        if not await asyncio.to_thread(files_present, entry):
            return None
        async with self._probe_lock:
            if entry in self._probes:
                return self._probes[entry]
            if self._closing:
                return None
            files = await asyncio.to_thread(files_stamp, entry)
            result = self._base_probes.get(entry.load_key)
            if result is None:
                result = await run_in_mlx_thread(
                    lambda: _probe_blocking(entry, self.backend, self.probe_store),
                    f"probe:{entry.name}",
                )
                self._base_probes[entry.load_key] = result
            if result.ok:
                problem = await asyncio.to_thread(_check_adapters, entry)
                if problem is not None:
                    result = ProbeResult(False, problem, None, result.seconds)
            result = replace(result, files=files)
            self._probes[entry] = result
        if result.remembered:
            log.info("probe %s: ok (unchanged since it was last probed)", entry.name)
        elif result.ok:
            log.info("probe %s: ok in %.2fs", entry.name, result.seconds)
        else:
            log.error("probe %s: unavailable: %s", entry.name, result.reason)
        return result

    async def _probe_again(self, entry: ModelEntry, failed: ProbeResult) -> ProbeResult | None:
        """`failed` stands while the files it was probed on are unchanged; once they change,
        the entry (and its base) is probed anew."""
        if await asyncio.to_thread(files_stamp, entry) == failed.files:
            return failed
        async with self._probe_lock:
            if self._probes.get(entry) is failed:
                del self._probes[entry]
                base = self._base_probes.get(entry.load_key)
                if base is not None and not base.ok:
                    del self._base_probes[entry.load_key]
        log.info("probe %s: its files changed since it failed; probing again", entry.name)
        return await self.probe(entry)

    def start_probes(self, entries: list[ModelEntry]) -> None:
        """Probe `entries` in the background, one after another; each is `probing` until its
        probe ends, and a request for it waits for (and hurries) its probe."""
        self._pending.update(entries)
        task = asyncio.get_running_loop().create_task(self.probe_all(entries))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def probe_all(self, entries: list[ModelEntry]) -> None:
        self._pending.update(entries)
        try:
            for entry in entries:
                if self._closing:
                    return
                try:
                    await self.probe(entry)
                finally:
                    self._pending.discard(entry)
        finally:
            self._pending.difference_update(entries)

    def probe_result(self, entry: ModelEntry) -> ProbeResult | None:
        return self._probes.get(entry)

    def probe_pending(self, entry: ModelEntry) -> bool:
        """Whether `entry`'s probe is queued or running."""
        return entry in self._pending

    # -- acquiring and releasing -------------------------------------------------------------

    async def acquire(self, entry: ModelEntry, keep_alive: float | None) -> tuple[Loaded, float]:
        """Hold the loaded pairing for `entry`; also the seconds spent waiting for it.

        Raises QueueFull when too many requests wait already, InsufficientMemory when the
        pairing can never fit, ModelUnavailable when it fails to load.
        """
        t0 = time.perf_counter()
        if self._closing:
            raise ServerClosing()
        if (entry.adapters or entry.draft_adapters) and not await asyncio.to_thread(
            files_present, entry
        ):  # its base may be here, loaded even: an adapter is not (a hub one not pulled yet)
            raise ModelNotPulled(f"model '{entry.name}': an adapter is not available locally")
        if entry in self._pending:  # probing: take its turn now rather than after the others
            await self.probe(entry)
        probed = self._probes.get(entry)
        if probed is not None and not probed.ok:
            probed = await self._probe_again(entry, probed)
        if probed is not None and not probed.ok:
            raise ModelUnavailable(f"model '{entry.name}' is unavailable: {probed.reason}")
        if entry.distributed is not None:
            self._check_group(entry)
        model = self._ready(entry)  # fast path: loaded, no load decision to wait for
        free_row = model is not None and not model.loading and model.users < self.num_parallel
        ticket = self.queue.enter(counted=not free_row)
        try:
            if model is not None:
                lease = self._attach(model, keep_alive, ticket)
            else:
                lease = await self._load(entry, keep_alive, ticket)
            lease.entry = lease.entry or entry
            lease.model.names.pop(lease.entry.name, None)
            lease.model.names[lease.entry.name] = None
        except BaseException:
            ticket.start()
            raise
        try:
            await lease.runner.wait_loaded()
        except BaseException as exc:
            self._load_failed(lease, exc)
            if isinstance(exc, Exception) and not isinstance(exc, ModelUnavailable):
                raise ModelUnavailable(str(exc) or type(exc).__name__) from exc
            raise
        if self._closing:  # told to stop while it waited: refused, as one arriving now is
            self.release(lease)
            raise ServerClosing()
        return lease, time.perf_counter() - t0

    def _check_group(self, entry: ModelEntry) -> None:
        """A distributed pairing whose group was lost stays unavailable, with the reason,
        until it is unloaded (`mlxd stop`) or the daemon restarts; its runner is retired."""
        lost = lost_reason(entry.name)
        if lost is None:
            return
        for model in list(self._loaded.values()):
            if model.entry.name == entry.name or entry.name in model.names:
                model.keep_alive = 0
                if model.users == 0:
                    self._retire(model)
        raise ModelUnavailable(f"model '{entry.name}' is unavailable: {lost}")

    def release(self, slot: Loaded) -> None:
        """The request is done with its pairing (idempotent)."""
        if slot.released:
            return
        slot.released = True
        slot.ticket.start()
        model = slot.model
        model.users = max(0, model.users - 1)
        model.last_used = time.monotonic()
        if model.users == 0:
            self._on_idle(model)

    async def generate(self, slot: Loaded, request: GenerationRequest) -> AsyncIterator[Event]:
        request.on_start = slot.ticket.start  # the scheduler calls it when the request starts
        runner = slot.runner
        if not isinstance(runner, PairingRunner):
            raise NotAGenerativeModel(slot.model.entry.name)
        if slot.entry is not None and not (request.adapters or request.draft_adapters):
            request.adapters = slot.entry.adapters  # an adapter entry's rows run on its adapters
            request.draft_adapters = slot.entry.draft_adapters
        try:
            async for event in runner.generate(request):
                slot.ticket.start()  # (idempotent) no longer waiting once the runner answers
                if isinstance(event, Done | Failed):
                    self._finished(slot.name, event)  # per entry: acceptance per adapter
                yield event
        finally:
            slot.ticket.start()

    def _finished(self, name: str, event: Done | Failed) -> None:
        for observe in self.finish_observers:
            try:
                observe(name, event)
            except Exception:  # an observer never breaks a stream
                log.exception("finish observer failed")

    def runner_restarted(self, name: str) -> None:
        """Count a restart of `name`'s runner (the watchdog abandoned it)."""
        self.counts.note(RUNNER_RESTART, name)

    async def embed(self, slot: Loaded, request: EmbedRequest) -> Embedded:
        """Embed `request`'s inputs on the held model (NotAnEmbeddingModel for a pairing)."""
        runner = slot.runner
        if not isinstance(runner, EmbeddingRunner):
            raise NotAnEmbeddingModel()
        slot.ticket.start()
        return await runner.embed(request)

    def pairing(self, slot: Loaded, what: str = "generate") -> Pairing:
        """The held pairing; `what` names the refused task for an embedding model."""
        if isinstance(slot.runner, EmbeddingRunner):
            raise NotAGenerativeModel(slot.model.entry.name, what)
        pairing = slot.runner.pairing
        if pairing is None:
            raise ModelUnavailable("model was unloaded")
        return pairing

    def _ready(self, entry: ModelEntry) -> Resident | None:
        """The loaded pairing `entry` can run on now, if any."""
        shared = self._loaded.get(("base", entry.load_key))
        if not _adapted(entry):
            own = self._loaded.get(("name", entry.name))
            if own is not None:
                return own if own.entry == entry else None
            return shared
        if shared is not None:
            return shared
        same = [m for m in self._loaded.values() if m.entry.load_key == entry.load_key]
        return same[0] if same else None

    def _attach(self, model: Resident, keep_alive: float | None, ticket: Ticket) -> Loaded:
        if keep_alive is not None:
            model.keep_alive = keep_alive
        model.users += 1
        model.expires_at, model.expires_wall = FOREVER, None
        model.last_used = time.monotonic()
        model.cancel_timer()
        ticket.attach(model)
        return Loaded(model, ticket)

    def _load_failed(self, lease: Loaded, exc: BaseException) -> None:
        if isinstance(exc, Exception):  # the load itself failed: forget the pairing
            model = lease.model
            if not model.retired:  # once per load, however many requests waited for it
                self.counts.note(LOAD_FAILURE, model.entry.name)
            if self._loaded.get(model.key) is model:
                del self._loaded[model.key]
            model.retired = True
        self.release(lease)

    # -- loading -----------------------------------------------------------------------------

    async def _load(self, entry: ModelEntry, keep_alive: float | None, ticket: Ticket) -> Loaded:
        async with self._load_lock:
            if self._closing:
                raise ServerClosing()
            entry = self._current(entry)
            model = self._ready(entry)
            if model is None:
                current = self._loaded.get(_key_for(entry))
                if current is not None:  # the registry entry changed: reload
                    self._retire(current)
                need = await asyncio.to_thread(
                    estimate_need, entry, self.num_parallel, self.backend
                )
                spec = await asyncio.to_thread(embedding_spec, entry)  # cached by now
                await self._make_room(need)
                entry = self._current(entry)  # edited or removed while it waited for room
                model = self._start(entry, need, spec)
            lease = self._attach(model, keep_alive, ticket)
            lease.entry = entry
            return lease

    def _current(self, entry: ModelEntry) -> ModelEntry:
        """The registry's entry of that name now: a request that waited for room while its
        entry was edited loads the edited one, and one whose entry was removed loads nothing."""
        if self.lookup is None:
            return entry
        found = self.lookup(entry.name)
        if found is None:
            raise ModelNotPulled(f"model '{entry.name}' was removed")
        return found

    def _start(
        self, entry: ModelEntry, need: MemoryNeed, spec: EmbeddingSpec | None = None
    ) -> Resident:
        probed = self._base_probes.get(entry.load_key)
        costs = probed.costs if probed is not None else None
        runner: PairingRunner | EmbeddingRunner
        if spec is not None:
            runner = EmbeddingRunner(entry, self.backend, spec)
        else:
            runner = PairingRunner(
                entry, self.backend, costs, self.prefix, self.num_parallel, self.adapter_bytes
            )
        model = Resident(
            entry, runner, need, self.default_keep_alive, key=_key_for(entry),
            files=files_stamp(entry),
        )  # fmt: skip
        self._loaded[model.key] = model
        self.counts.note(LOAD, entry.name)
        log.info("loading %s (%s)", entry.name, human_bytes(need.total))
        self._start_watchdog()
        return model

    # -- the watchdog ------------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        if self.stall_limit > 0 and (self._watchdog is None or self._watchdog.done()):
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_runners())

    async def _watch_runners(self) -> None:
        """Every quarter of the limit (at most 5 s), look for runners stuck in a step."""
        every = min(self.stall_limit / 4, 5.0)
        while self._loaded or self._retiring:
            await asyncio.sleep(every)
            now = time.monotonic()
            for model in [*self._loaded.values(), *self._retiring]:
                stalled = model.runner.stalled_for(now)
                if stalled > self.stall_limit and not model.abandoned:
                    self._abandon(model, stalled)

    def _abandon(self, model: Resident, stalled: float) -> None:
        """Take a stuck runner out of service: its requests end with an error line, its
        thread is left to exit if it ever can (its memory is no longer counted: it may never
        come back), and a fresh runner loads the pairing unless it was leaving anyway."""
        name = model.entry.name
        leaving = model.retired
        answered = model.runner.abandon(
            f"model '{name}' stopped making progress ({stalled:.0f}s without finishing a step)"
            " and is being reloaded; please retry"
        )
        log.error(
            "runner of %s made no progress for %.0fs: %d request(s) failed, %s",
            name, stalled, answered, "not reloading (it was unloading)" if leaving else "reloading",
        )  # fmt: skip
        self.stalls += 1
        self.runner_restarted(name)
        model.abandoned = model.retired = model.stopped = True
        model.cancel_timer()
        if self._loaded.get(model.key) is model:
            del self._loaded[model.key]
        if model in self._retiring:
            self._retiring.remove(model)
        self._notify()
        if not leaving and model.keep_alive > 0:
            task = asyncio.get_running_loop().create_task(self._reload(model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reload(self, stuck: Resident) -> None:
        """Load the pairing of an abandoned runner on a fresh runner, kept as it was."""
        entry = stuck.entry
        try:
            async with self._load_lock:
                if stuck.key in self._loaded:
                    return  # a request loaded it meanwhile
                await self._make_room(stuck.need)
                spec = stuck.runner.spec if isinstance(stuck.runner, EmbeddingRunner) else None
                model = self._start(entry, stuck.need, spec)
                model.keep_alive = stuck.keep_alive
                self._on_idle(model)
        except Exception:
            log.exception("reloading %s failed; the next request loads it", entry.name)

    def memory_used(self) -> int:
        return sum(m.need.total for m in [*self._loaded.values(), *self._retiring])

    def _fits(self, need: MemoryNeed) -> bool:
        count = len(self._loaded) + len(self._retiring)
        return count < self.max_loaded and self.memory_used() + need.total <= self.budget.bytes

    async def _make_room(self, need: MemoryNeed) -> None:
        """Unload idle models, else wait for busy ones to finish, until `need` fits."""
        if need.total > self.budget.bytes:
            raise InsufficientMemory(
                f"model requires {human_bytes(need.total)} but only"
                f" {human_bytes(self.budget.bytes)} are available"
                f" (memory budget: {self.budget.source})"
            )
        try:
            while not self._fits(need):
                self._evict_one()
                await self._changed()
                if self._closing:
                    raise ServerClosing()
        except BaseException:
            self._keep_evicted()
            raise

    def _keep_evicted(self) -> None:
        """A load that gave up waiting (its client left) no longer needs the busy model it
        chose to make room: that one stays in service rather than go for nobody."""
        for model in list(self._retiring):
            if (
                model.evicted
                and not model.stopped
                and self._loaded.get(model.key) is None
                and files_stamp(model.entry) == model.files  # not where new files came
            ):
                self._retiring.remove(model)
                model.retired = model.evicted = False
                self._loaded[model.key] = model
                log.info("keeping %s: the load it was making room for gave up", model.entry.name)

    def _evict_one(self) -> None:
        """Unload the idle model that goes first, else choose a busy one and wait for it: as
        Ollama's scheduler does, the one chosen is waited for, and a model that falls idle
        meanwhile stays (evicting it too would free two places for one load)."""
        if any(m.evicted for m in self._retiring):  # until its memory is free again
            return
        order = sorted(self._loaded.values(), key=_eviction_order)
        idle = [m for m in order if m.users == 0]
        if idle:
            log.info("unloading %s to make room", idle[0].entry.name)
            self.counts.note(EVICTION, _served(idle[0])[0])
            self._retire(idle[0])
        elif order and not self._retiring:  # nothing on its way out: let a busy one finish
            log.info("waiting for %s to finish to make room", order[0].entry.name)
            order[0].evicted = True  # counted once it stops (`_keep_evicted` may keep it)
            self._retire(order[0])

    async def _changed(self) -> None:
        """Until a model becomes idle or lets go of its memory."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def _notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- unloading ---------------------------------------------------------------------------

    def _on_idle(self, model: Resident) -> None:
        if model.retired or model.keep_alive <= 0:
            self._retire(model)
            return
        model.expires_at = time.monotonic() + model.keep_alive
        if model.keep_alive != FOREVER:
            model.expires_wall = time.time() + model.keep_alive
            loop = asyncio.get_running_loop()
            model.timer = loop.call_later(model.keep_alive, self._expire, model)
        self._notify()

    def _expire(self, model: Resident) -> None:
        model.timer = None
        if model.users == 0 and self._loaded.get(model.key) is model:
            log.info("keep_alive expired for %s", model.entry.name)
            self._retire(model)

    def _retire(self, model: Resident) -> None:
        """Take `model` out of service; it stops now if idle, else when its last user leaves."""
        model.cancel_timer()
        if self._loaded.get(model.key) is model:
            del self._loaded[model.key]
        if model not in self._retiring and not model.abandoned:
            self._retiring.append(model)
        model.retired = True
        if model.users == 0 and not model.stopped:
            if model.evicted:  # chosen busy to make room: counted as it goes (it may stay)
                self.counts.note(EVICTION, _served(model)[0])
            model.stopped = True
            model.runner.stop()
            task = asyncio.get_running_loop().create_task(self._reap(model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            log.info("unloading %s", model.entry.name)

    async def _reap(self, model: Resident) -> None:
        """Once the runner's thread has exited, its memory counts as free again."""
        try:
            await asyncio.to_thread(model.runner.join, JOIN_TIMEOUT)
        finally:
            if model in self._retiring:
                self._retiring.remove(model)
            self._notify()

    def unload(self, name: str, shared: bool = False) -> bool:
        """Unload now if idle, else as soon as its requests finish; never waits. With `shared`
        (`name` is served no more as it was: deleted, or changed in the registry) a base that
        other entries use stays loaded for them: removing one adapter entry is no reason to
        drop the base the others decode on."""
        found = [m for m in self._loaded.values() if m.entry.name == name or name in m.names]
        forget_loss(name)  # a lost distributed group is tried afresh on the next load
        for model in found:
            model.names.pop(name, None)
            if shared and model.names:
                continue
            model.keep_alive = 0
            if model.users == 0:
                self._retire(model)
        return bool(found)

    def unload_changed(self) -> list[str]:
        """Take out of service the models whose files changed since they loaded (a pull that
        fetched a new revision of a served repo): the next request loads the new files, as
        Ollama reloads a model whose files changed; requests already on the old one finish
        there. The names retired."""
        changed = [m for m in self._loaded.values() if files_stamp(m.entry) != m.files]
        for model in changed:
            log.info("the files of %s changed: the next request loads them", model.entry.name)
            self._retire(model)
        return [m.entry.name for m in changed]

    def loaded(self) -> dict[str, Resident]:
        """Loaded bases by the name of the entry each was loaded for."""
        return {m.entry.name: m for m in self._loaded.values()}

    def _in_service(self) -> list[Resident]:
        """Every model loaded, plus busy ones on their way out (a name may be on two: the
        copy leaving and a fresh load of new files)."""
        return [*self._loaded.values(), *(m for m in self._retiring if m.users > 0)]

    def shown(self) -> list[tuple[str, Resident]]:
        """Every model in service with the name `/api/ps` shows it under."""
        return [(_served(m)[0], m) for m in self._in_service()]

    def status(self) -> list[ModelStatus]:
        """Every model in service, plus busy ones on their way out."""
        now = time.monotonic()
        return [_status(m, now) for m in self._in_service()]

    def stop_serving(self) -> int:
        """The daemon was told to stop: refuse requests waiting for a model (`ServerClosing`)
        and end the running ones with an error now (a stream's last line says why), so the
        server's connections close at once rather than at its graceful-shutdown timeout.
        Returns how many running requests were ended."""
        self._closing = True
        ended = 0
        for model in [*self._loaded.values(), *self._retiring]:
            if isinstance(model.runner, PairingRunner):
                ended += model.runner.end_requests(CLOSING)
            else:
                ended += model.runner.end_requests(ServerClosing)
        self._notify()  # waiters for room wake up and see the daemon closing
        return ended

    async def shutdown(self) -> None:
        # A probe's thread runs MLX work that cannot be interrupted, and a process that exits
        # while such a thread runs aborts: let the probe in progress end (no further one starts).
        self._closing = True
        try:
            await asyncio.wait_for(self._probe_lock.acquire(), PROBE_SHUTDOWN_WAIT)
            self._probe_lock.release()
        except asyncio.TimeoutError:
            log.warning("a probe still runs after %.0fs; exiting anyway", PROBE_SHUTDOWN_WAIT)
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._tasks):
            task.cancel()
        models = [*self._loaded.values(), *self._retiring]
        self._loaded.clear()
        self._retiring.clear()
        for model in models:
            model.cancel_timer()
            model.runner.stop()
        for model in models:
            await asyncio.to_thread(model.runner.join, 10.0)
        self._notify()
        if self.prefix is not None:
            await asyncio.to_thread(self.prefix.close)  # RAM-only blocks reach the SSD tier
