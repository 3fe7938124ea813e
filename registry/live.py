"""The registry a running daemon serves: swapped whole on reload, last good kept on errors."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mlxd.registry.registry import Registry
from mlxd.registry.schema import RegistryError

log = logging.getLogger(__name__)


class LiveRegistry:
    """Callable returning the current Registry; `reload()` re-reads the files.

    A request that already looked a model up keeps its entry: reload never mutates a Registry,
    it replaces the reference.
    """

    def __init__(self, load: Callable[[], Registry]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._current = load()
        self.last_error: RegistryError | None = None

    def __call__(self) -> Registry:
        return self._current

    def reload(self) -> RegistryError | None:
        """Re-read the registry files; on an invalid edit keep serving the last good registry."""
        with self._lock:
            try:
                fresh = self._load()
            except RegistryError as exc:
                self.last_error = exc
                log.error("registry reload failed, keeping the last good registry: %s", exc)
                return exc
            self._current = fresh
            self.last_error = None
            return None
