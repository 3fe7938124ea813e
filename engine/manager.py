"""Which pairings are loaded: load on demand, keep_alive expiry, a cap on loaded models."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import mlx.core as mx

from engine.events import Event, GenerationRequest
from engine.pairing import ModelUnavailable, Pairing, load_pairing
from engine.prefix_cache import PrefixCache
from engine.runner import PairingRunner
from engine.speculation import Costs
from registry.schema import ModelEntry
from registry.store import resolve_local

log = logging.getLogger(__name__)

FOREVER = float("inf")


@dataclass(frozen=True)
class ProbeResult:
    """What opening a pairing at startup (or after a registry change) found."""

    ok: bool
    reason: str | None = None
    costs: Costs | None = None
    seconds: float = 0.0


def files_present(entry: ModelEntry) -> bool:
    return resolve_local(entry.target) is not None and (
        entry.draft is None or resolve_local(entry.draft) is not None
    )


def _probe_blocking(entry: ModelEntry) -> ProbeResult:
    t0 = time.perf_counter()
    try:
        pairing = load_pairing(entry)
    except Exception as exc:
        return ProbeResult(False, str(exc) or type(exc).__name__, None, time.perf_counter() - t0)
    costs = pairing.costs
    del pairing
    gc.collect()
    mx.clear_cache()
    return ProbeResult(True, None, costs, time.perf_counter() - t0)


@dataclass
class Loaded:
    runner: PairingRunner
    keep_alive: float  # seconds; inf = forever, 0 = unload when idle
    expires_at: float = FOREVER  # monotonic time; inf while in use
    users: int = 0


class ModelManager:
    """Owns every PairingRunner; the API asks it for a loaded pairing and a stream of events."""

    def __init__(
        self,
        default_keep_alive: float = 300.0,
        max_loaded: int = 3,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.prefix = prefix  # shared by every pairing; namespaces keep them apart
        self.default_keep_alive = default_keep_alive
        self.max_loaded = max(1, max_loaded)
        self._loaded: dict[str, Loaded] = {}
        self._probes: dict[ModelEntry, ProbeResult] = {}
        self._probe_lock = asyncio.Lock()
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None

    # -- probe-open ----------------------------------------------------------------------------

    async def probe(self, entry: ModelEntry) -> ProbeResult | None:
        """Open and check a pairing whose files are present; None when they are not."""
        if not await asyncio.to_thread(files_present, entry):
            return None
        async with self._probe_lock:
            if entry in self._probes:
                return self._probes[entry]
            result = await asyncio.to_thread(_probe_blocking, entry)
            self._probes[entry] = result
        if result.ok:
            log.info("probe %s: ok in %.2fs", entry.name, result.seconds)
        else:
            log.error("probe %s: unavailable: %s", entry.name, result.reason)
        return result

    async def probe_all(self, entries: list[ModelEntry]) -> None:
        for entry in entries:
            await self.probe(entry)

    def probe_result(self, entry: ModelEntry) -> ProbeResult | None:
        return self._probes.get(entry)

    # -- loading -----------------------------------------------------------------------------

    async def acquire(self, entry: ModelEntry, keep_alive: float | None) -> tuple[Loaded, float]:
        """The loaded pairing for `entry` and the seconds this call spent waiting for its load."""
        self._ensure_reaper()
        t0 = time.perf_counter()
        probed = self._probes.get(entry)
        if probed is not None and not probed.ok:
            raise ModelUnavailable(f"model '{entry.name}' is unavailable: {probed.reason}")
        async with self._lock:
            slot = self._loaded.get(entry.name)
            if slot is not None and slot.runner.entry != entry:
                self._unload(entry.name)  # the registry entry changed: reload
                slot = None
            if slot is None:
                self._make_room()
                costs = probed.costs if probed is not None else None
                slot = Loaded(PairingRunner(entry, costs, self.prefix), self.default_keep_alive)
                self._loaded[entry.name] = slot
            if keep_alive is not None:
                slot.keep_alive = keep_alive
            slot.users += 1
            slot.expires_at = FOREVER
        try:
            await slot.runner.wait_loaded()
        except BaseException as exc:
            async with self._lock:
                if self._loaded.get(entry.name) is slot:
                    del self._loaded[entry.name]
            if isinstance(exc, ModelUnavailable):
                raise
            if isinstance(exc, Exception):
                raise ModelUnavailable(str(exc)) from exc
            raise
        return slot, time.perf_counter() - t0

    def release(self, slot: Loaded) -> None:
        slot.users -= 1
        if slot.users <= 0:
            slot.users = 0
            slot.expires_at = time.monotonic() + slot.keep_alive
            if slot.keep_alive <= 0:
                self._unload_slot(slot)

    async def generate(self, slot: Loaded, request: GenerationRequest) -> AsyncIterator[Event]:
        async for event in slot.runner.generate(request):
            yield event

    def pairing(self, slot: Loaded) -> Pairing:
        pairing = slot.runner.pairing
        if pairing is None:
            raise ModelUnavailable("model was unloaded")
        return pairing

    # -- unloading ---------------------------------------------------------------------------

    def _make_room(self) -> None:
        while len(self._loaded) >= self.max_loaded:
            idle = [(s.keep_alive, name) for name, s in self._loaded.items() if s.users == 0]
            if not idle:
                return  # everything is busy: load anyway rather than fail a request
            self._unload(min(idle)[1])

    def _unload(self, name: str) -> None:
        slot = self._loaded.pop(name, None)
        if slot is not None:
            slot.runner.stop()
            log.info("unloaded %s", name)

    def _unload_slot(self, slot: Loaded) -> None:
        for name, s in list(self._loaded.items()):
            if s is slot:
                self._unload(name)

    def unload(self, name: str) -> bool:
        """Unload now if idle, else as soon as its requests finish."""
        slot = self._loaded.get(name)
        if slot is None:
            return False
        slot.keep_alive = 0
        if slot.users == 0:
            self._unload(name)
        return True

    def loaded(self) -> dict[str, Loaded]:
        return dict(self._loaded)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for name, slot in list(self._loaded.items()):
                if slot.users == 0 and slot.expires_at <= now:
                    self._unload(name)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        runners = [slot.runner for slot in self._loaded.values()]
        self._loaded.clear()
        for runner in runners:
            runner.stop()
        for runner in runners:
            await asyncio.to_thread(runner.join, 10.0)
        if self.prefix is not None:
            await asyncio.to_thread(self.prefix.close)  # RAM-only blocks reach the SSD tier
