"""Startup probing and registry hot reload: the daemon keeps what it serves in step with the
registry files without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path

from watchfiles import Change, awatch

from mlxd.engine.manager import ModelManager
from mlxd.registry.live import LiveRegistry
from mlxd.registry.registry import Registry
from mlxd.registry.schema import ModelEntry, RegistryError

log = logging.getLogger(__name__)


def changed_entries(before: Registry, after: Registry) -> tuple[list[str], list[ModelEntry]]:
    """(names whose loaded pairing is stale, entries to probe). An adapter entry whose base
    stays the same is not stale: its new adapters mount on the loaded base per request."""
    old = {e.key: e for e in before.entries()}
    new = {e.key: e for e in after.entries()}
    stale = [old[k].name for k in old if k not in new or _stale(old[k], new[k])]
    fresh = [new[k] for k in new if k not in old or new[k] != old[k]]
    return stale, fresh


def _stale(old: ModelEntry, new: ModelEntry) -> bool:
    if old.load_key != new.load_key:
        return True
    adapted = bool(old.adapters or old.draft_adapters or new.adapters or new.draft_adapters)
    return not adapted and _served(new) != _served(old)


def _served(entry: ModelEntry) -> ModelEntry:
    """The entry less what only describes it (a copy onto its own name writes a new time):
    such an edit leaves a loaded pairing loaded."""
    return replace(entry, description=None, license=(), modified_at=None)


class Lifecycle:
    """Probes every pairing in the background from startup, and watches the registry files."""

    def __init__(self, live: LiveRegistry, manager: ModelManager, watch: bool = True) -> None:
        self.live = live
        self.manager = manager
        self.watch = watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def startup(self) -> None:
        """Ready at once: pairings are probed in the background (`probing` until done)."""
        self._loop = asyncio.get_running_loop()
        self.manager.start_probes(self.live().entries())
        if self.watch:
            self._watcher = self._loop.create_task(self._watch(self.live().paths))

    async def shutdown(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for task in list(self._tasks):
            task.cancel()

    def stop_serving(self) -> None:
        """The daemon was told to stop (from any thread: a signal handler): running requests
        end with an error line and waiting ones are refused now, so the server's connections
        close at once instead of at its graceful-shutdown timeout."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_serving)

    def _stop_serving(self) -> None:
        ended = self.manager.stop_serving()
        if ended:
            log.info("shutting down: ended %d running requests", ended)

    def reload(self) -> RegistryError | None:
        """Re-read the registry (from any thread); stale pairings unload once idle, loaded
        ones whose files changed (a pull) leave service, new ones are probed in the
        background."""
        before = self.live()
        error = self.live.reload()
        if error is not None:
            return error
        stale, fresh = changed_entries(before, self.live())
        if self._loop is not None:  # an entry as it was may have new files (a pull)
            self._loop.call_soon_threadsafe(self._apply, stale, fresh)
        return None

    def _apply(self, stale: list[str], fresh: list[ModelEntry]) -> None:
        for name in stale:
            self.manager.unload(name, shared=True)
        self.manager.unload_changed()
        if fresh:
            log.info("registry changed: %s", ", ".join(e.name for e in fresh) or "removals only")
            task = asyncio.get_running_loop().create_task(self.manager.probe_all(fresh))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _watch(self, paths: Sequence[Path]) -> None:
        """Only the registry files: each folder non-recursively, events filtered to those names.

        A registry file may sit in $MLXD_HOME next to the daemon's own log; watching more than
        the files would turn every log line into a change event (and watchfiles' own log line
        about it into another). A file given as a symbolic link is watched as the link and as
        the file it points to; once the link points elsewhere, the new file is watched instead.
        """
        logging.getLogger("watchfiles").setLevel(logging.WARNING)
        repointed = False
        while not self._stop.is_set():
            files = watched_files(paths)
            dirs = sorted({str(f.parent) for f in files if f.parent.is_dir()})
            if not dirs:
                return
            log.info("watching registry files: %s", ", ".join(map(str, sorted(files))))
            changes = awatch(
                *dirs,
                watch_filter=registry_filter(files),
                recursive=False,
                stop_event=self._stop,
                debounce=200,
                step=50,
            )
            if repointed:
                self.reload()  # what the new file became while no watcher had its folder
            async with contextlib.aclosing(changes):
                async for _ in changes:
                    self.reload()
                    repointed = watched_files(paths) != files
                    if repointed:
                        break  # a link was repointed: its new file's folder is watched next


def watched_files(paths: Sequence[Path]) -> frozenset[Path]:
    """Each registry path as given (absolute) and as it resolves (a link's file)."""
    files = set()
    for p in paths:
        given = p.expanduser().absolute()
        files |= {given, given.resolve()}
    return frozenset(files)


def registry_filter(files: Collection[Path]) -> Callable[[Change, str], bool]:
    """A watchfiles filter passing events on exactly `files` (resolved paths)."""
    wanted = {str(f) for f in files}

    def keep(change: Change, path: str) -> bool:
        return path in wanted or str(Path(path).resolve()) in wanted

    return keep
