"""Progress beats from inside a long step, for the watchdog that reloads a stuck runner.

A runner beats after every scheduler step; a few steps are long by nature (a solo request's
prefill of a long prompt reads it in one call). Code that loops inside such a step calls
`beat()` as it goes, and the runner thread that installed a beat with `beat_with` counts it as
progress. Threads without one (probes, tools) beat into nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from mlxd.engine.threads import reset_after_work

_local = threading.local()


def beat_with(fn: Callable[[], None] | None) -> None:
    """Install this thread's beat (None removes it)."""
    _local.beat = fn


def beat() -> None:
    fn: Callable[[], None] | None = getattr(_local, "beat", None)
    if fn is not None:
        fn()


reset_after_work(lambda: beat_with(None))  # a pooled thread's next work is not that runner's
