"""A row's speculation as one state machine: on, paused(n), off.

ON: every round asks the draft source for up to k tokens (k from the row's controller).
PAUSED(n): speculation stopped paying; the next n committed tokens are decoded plainly, then
a trial round runs (ON again), unless the source would first have to catch up on more tokens
than the rest of the request can repay (a draft model that read nothing during the pause): then
OFF, and the pairing's pause clock schedules the next trial at a later request's start. A
trial the acceptance seen so far says loses (`hopeless`) is not run: another, longer pause.
OFF: plain decoding to the end (no source, a source that failed, a target cache that cannot
be trimmed, or a controller that gave up). The state belongs to the row, not to the way it is
stepped: a row moving between solo and batched decoding keeps it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from mlxd.engine.drafting import DraftSource
from mlxd.engine.speculation import DraftLengthController, SpecStats

log = logging.getLogger(__name__)

# A paused draft model resumes only where the request has this many tokens left per token it
# must catch up on: reading the pause's tokens costs a prefill that a short rest cannot repay.
CATCH_UP_RATIO = 8


def _always() -> bool:
    return True


class Mode(Enum):
    ON = "on"
    PAUSED = "paused"
    OFF = "off"


class Speculation:
    def __init__(
        self,
        source: DraftSource | None,
        controller: DraftLengthController | None,
        stats: SpecStats,
    ) -> None:
        self.source = source
        self.controller = controller
        self.stats = stats
        self.mode = Mode.ON if source is not None and controller is not None else Mode.OFF
        self.pause_left = 0
        # after stepping down to a cheaper arm: the full source's controller and the token count
        # then; what the arm decodes counts toward that source's pause clock
        self._stepped_from: tuple[DraftLengthController, int] | None = None
        if source is not None:
            stats.method = source.name

    @property
    def on(self) -> bool:
        return self.mode is Mode.ON

    def draft_length(self, produced: int) -> int:
        """Drafts wanted in the next round (0 unless ON), after the controller's verdict on
        the rounds so far may have stepped down, paused or ended speculation."""
        if self.mode is Mode.ON:
            assert self.controller is not None
            if self.controller.off:
                self._step_down(produced)
        if self.mode is not Mode.ON:
            return 0
        assert self.controller is not None
        return self.controller.choose()

    def _step_down(self, produced: int) -> None:
        """Speculation stopped paying: continue with the source's cheaper arm, or pause it
        (backing off each time), or end it for this row."""
        assert self.source is not None and self.controller is not None
        cheaper = self.source.cheaper()
        if cheaper is not None:
            self.stats.disabled_reason = f"{self.source.name}: continued with {cheaper.name} only"
            self._stepped_from = (self.controller, produced)
            self.source = cheaper
            self.controller = self.controller.restart(draft_cost=0.0, source=cheaper.name)
            return
        pause = self.controller.pause_tokens
        if pause <= 0:
            self.stop("speculation no longer pays", failed=False)
            return
        self.stats.paused += 1
        self.stats.disabled_reason = f"speculation paused {self.stats.paused} time(s): not paying"
        self.mode, self.pause_left = Mode.PAUSED, pause

    def committed_plainly(self, tokens: int, worth_resuming: Callable[[], bool] = _always) -> None:
        """`tokens` were decoded without drafts; a pause counts them down and ends in a trial,
        or (when `worth_resuming` says catching the source up would not pay) in OFF."""
        if self.mode is not Mode.PAUSED or tokens <= 0:
            return
        assert self.controller is not None
        spent = min(tokens, self.pause_left)
        self.controller.paused_for(spent)
        self.pause_left -= spent
        if self.pause_left > 0:
            return
        if not worth_resuming():
            self.stop("speculation paused: catching the draft up would not pay", failed=False)
            return
        if self.controller.hopeless():
            self.controller.skip_trial()  # the trial would lose: a longer pause instead
            self.pause_left = self.controller.pause_tokens
            return
        self.controller.resume()
        self.mode = Mode.ON

    def stop(self, reason: str, failed: bool = True) -> None:
        """OFF for good: plain decoding to the end."""
        if failed:
            log.warning("speculation stopped, continuing with plain decoding: %s", reason)
            self.stats.fallback_reason = reason
        else:
            self.stats.disabled_reason = reason
        self.mode = Mode.OFF
        self.pause_left = 0
        self._drop_source()

    def _drop_source(self) -> None:
        if self.source is not None:
            try:
                self.source.dispose()
            finally:
                self.source = None

    def close(self, produced: int) -> None:
        if self._stepped_from is not None:
            full, start = self._stepped_from
            full.paused_for(produced - start)
            self._stepped_from = None
        if self.controller is not None:
            self.controller.conclude()
        self._drop_source()
