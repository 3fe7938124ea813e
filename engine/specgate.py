"""A batch's speculation floor, measured: rows draft only at row counts where drafting was
seen to commit more tokens a second than not drafting.

The batch's plan prices each verify round from measured rounds and each row's acceptance
(`batch.plan_widths`), and a row the plan declines pauses; but a price leaves out what a
model of rounds does not see (the host's work for drafts, rounds that stop pipelining, every
round's bookkeeping). On an H100 (an 8B-shaped bf16 model, 8 clients, 128 tokens each),
speculation by prompt lookup served 612-679 tok/s where the same daemon decoding plainly
served 928. The gate compares the two directly, per row count: epochs of `EPOCH_ROUNDS`
rounds with drafting allowed and with it not, each scored by the tokens the batch committed
over the wall time of its rounds (return to return; rounds where no row has a draft source
are not scored), and the better runs on (drafting, unless it scored under `FLOOR` of not
drafting). A round over `STALL` times its epoch's median (a shape's first forward compiling
on a GPU: once 2.3 s where such rounds take 10 ms) is left out of its epoch's score, tokens
and all: a one-off stall is neither arm's cost, and scored it sank the arm it hit for
`RETRY_EPOCHS` epochs or more. The first epoch drafts (a batch where drafting pays starts
paying at once), the next does not (the baseline); after that the loser is tried again after
`RETRY_EPOCHS` of the winner's epochs, twice as many each time it loses again (up to
`MAX_RETRY_EPOCHS`), so that a drafting that loses costs a few per cent of rounds at most.
While drafting is not allowed nothing drafts and no row is benched: the rounds are the plain
rounds of a batch without speculation.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from mlxd.engine.speculation import floor_on

log = logging.getLogger(__name__)

EPOCH_ROUNDS = 32  # rounds of a row count scored together
# drafting runs while it scores at least this share of not drafting's rate: a drafting arm
# within noise of plain decoding keeps its chance at the stretches where it pays
FLOOR = 0.97
RETRY_EPOCHS = 8  # the winner's epochs before the loser is tried again, at first
MAX_RETRY_EPOCHS = 64
# a round this many times its epoch's median is a stall, not scored; slower rounds that recur
# (a draft model's steps, a wide verify) sit well under it
STALL = 10.0


@dataclass
class _Count:
    """One row count's record: the last score of each arm (True: drafting allowed) and the
    epoch running now."""

    rates: dict[bool, float] = field(default_factory=dict)
    drafting: bool = True
    rounds: list[tuple[int, float]] = field(default_factory=list)  # this epoch's (tokens, s)
    since_trial: int = 0  # the winner's epochs since the loser last ran
    retry: int = RETRY_EPOCHS  # the winner's epochs before the loser's next trial
    trial: bool = False  # the epoch running now tries the loser again


@dataclass
class SpecGate:
    counts: dict[int, _Count] = field(default_factory=dict)

    def allows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows may draft now (always, with the floor off:
        `MLXD_SPEC_FLOOR=0`)."""
        return not floor_on() or self._count(rows).drafting

    def rate(self, rows: int, drafting: bool) -> float | None:
        """The last score of an arm at `rows` rows: committed tokens a second."""
        return self._count(rows).rates.get(drafting)

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """A round of `rows` rows (the same rows as the round before) that committed `tokens`
        in `seconds`, return to return."""
        c = self._count(rows)
        c.rounds.append((tokens, seconds))
        if len(c.rounds) < EPOCH_ROUNDS:
            return
        first = c.drafting not in c.rates  # this arm's first score
        judged = first or c.trial
        arm = c.drafting
        c.rates[arm], stalls = _score(c.rounds)
        c.rounds = []
        c.drafting = self._next(c, first)
        if judged or stalls:  # a comparison, or rounds left out: rare enough to log each
            log.info(
                "speculation gate: %d rows, %s scored %.1f tok/s (%d stalled rounds left out);"
                " %s runs next",
                rows, "drafting" if arm else "plain", c.rates[arm], stalls,
                "drafting" if c.drafting else "plain",
            )  # fmt: skip

    def _next(self, c: _Count, first: bool) -> bool:
        if False not in c.rates:
            return False  # the baseline, once
        winner = c.rates.get(True, 0.0) >= FLOOR * c.rates[False]
        if first or c.trial:
            if c.trial:  # the loser, tried again: its record says how long until the next try
                c.retry = (
                    RETRY_EPOCHS if c.drafting == winner else min(2 * c.retry, MAX_RETRY_EPOCHS)
                )
            c.trial, c.since_trial = False, 0
            return winner
        c.since_trial += 1
        if c.since_trial >= c.retry:
            c.trial = True
            return not winner
        return winner

    def _count(self, rows: int) -> _Count:
        c = self.counts.get(rows)
        if c is None:
            c = self.counts[rows] = _Count()
        return c


def _score(rounds: list[tuple[int, float]]) -> tuple[float, int]:
    """Tokens a second over an epoch's rounds, its stalls left out; and how many were."""
    limit = STALL * statistics.median(s for _, s in rounds)
    kept = [(t, s) for t, s in rounds if s <= limit]
    rate = sum(t for t, _ in kept) / max(sum(s for _, s in kept), 1e-9)
    return rate, len(rounds) - len(kept)
