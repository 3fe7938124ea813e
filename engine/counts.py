"""Counts of rare model lifecycle events (loads, evictions, runner restarts), per model.

They happen a few times an hour at most, so a lock per event costs nothing; `/metrics` reads a
snapshot when it is scraped.
"""

from __future__ import annotations

import threading

LOAD = "load"
LOAD_FAILURE = "load_failure"
EVICTION = "eviction"  # unloaded to make room for another model
RUNNER_RESTART = "runner_restart"
EVENTS = (LOAD, LOAD_FAILURE, EVICTION, RUNNER_RESTART)


class LifecycleCounts:
    """How often each event happened to each model since the daemon started."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def note(self, event: str, model: str) -> None:
        """Count one `event` for `model` (any thread)."""
        if event not in EVENTS:
            raise ValueError(f"unknown lifecycle event {event!r}")
        with self._lock:
            self._counts[event, model] = self._counts.get((event, model), 0) + 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """event -> model -> count, every event present (empty when it never happened)."""
        out: dict[str, dict[str, int]] = {event: {} for event in EVENTS}
        with self._lock:
            for (event, model), count in self._counts.items():
                out[event][model] = count
        return out
