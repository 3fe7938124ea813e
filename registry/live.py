"""The registry a running daemon serves: swapped whole on reload, last good kept on errors.

Editors save by truncating a file and then writing it, so a reload can land between the two:
an empty file that would change what is served is taken as not yet written, and a file that
changes while it is read is read again (a few times: concurrent `create`s and `cp`s each
replace it whole, and each one's reload must see its own entry), then on its next change.
Either way, and for an invalid edit, the last good registry keeps serving and `errors()` says
why until a reload succeeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mlxd.registry.registry import Registry
from mlxd.registry.schema import RegistryError

log = logging.getLogger(__name__)

READS = 5  # reads of a registry that keeps changing while it is read, before giving up

Stamp = tuple[int, int] | None  # (size, mtime_ns); None when the file is absent


def _stamps(paths: Sequence[Path]) -> list[Stamp]:
    out: list[Stamp] = []
    for path in paths:
        try:
            st = Path(path).expanduser().stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_size, st.st_mtime_ns))
    return out


def _blank(path: Path) -> bool:
    try:
        return not Path(path).expanduser().read_bytes().strip()
    except OSError:
        return False  # absent: an optional file the registry skips, or an error load reports


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

    def errors(self) -> list[str]:
        """Why the last reload was not applied (empty once one succeeds)."""
        error = self.last_error
        return [str(error)] if error is not None else []

    def reload(self) -> RegistryError | None:
        """Re-read the registry files; on an invalid or unfinished edit keep serving the last
        good registry."""
        with self._lock:
            try:
                fresh = self._read()
            except RegistryError as exc:
                self.last_error = exc
                log.error("registry reload failed, keeping the last good registry: %s", exc)
                return exc
            self._current = fresh
            self.last_error = None
            return None

    def _read(self) -> Registry:
        paths = self._current.paths
        for attempt in range(READS):
            before = _stamps(paths)
            fresh = self._load()
            changed = [p for p, a, b in zip(paths, before, _stamps(paths), strict=True) if a != b]
            if not changed:
                break
            if attempt == READS - 1:
                raise RegistryError(
                    f"{changed[0]}: changed while being read; read again on its next change"
                )
            time.sleep(0.01 * (attempt + 1))
        if fresh.entries() != self._current.entries():
            for path in paths:
                if _blank(path):
                    raise RegistryError(
                        f"{path}: empty, taken as not yet written (write 'models: {{}}' to"
                        " remove every model)"
                    )
        return fresh
