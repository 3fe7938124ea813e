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
paying at once), the next does not (the baseline). Where drafting lost and its rows drafted
with a model (`auto`: prompt lookup where the text repeats, else the draft model), a third
epoch drafts only what runs no draft model (`FREE`: lookup's, forced tokens): on a GPU a
0.5B-shaped draft step costs 0.4 of a 7B-shaped target's, so a batch's model drafts can lose
where its lookup drafts pay, and scored as one arm they sank both. The best arm runs on
(drafting unless it scored under `FLOOR` of not drafting, or under not drafting's rate where
its drafts gained less than `GAIN_SHARE` of its tokens: no stretch of it paid; free drafts
alone only at not drafting's rate or better and where they gained `GAIN_SHARE` of their
epoch's tokens, below which their best gain is within an epoch's noise: `_winner`). Each
loser is tried again after `RETRY_EPOCHS` of the winner's epochs, twice as many each time it
loses again (up to `MAX_RETRY_EPOCHS`), so that a drafting that loses costs a few per cent of
rounds at most. A row count not yet compared starts from the verdict of a compared one beside
it (`SpecGate._borrow`): rows that come and go spend rounds at counts that never run an epoch.
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
# the share of an epoch's tokens its drafts must have gained for drafting to run on within
# `FLOOR` of not drafting, and for free drafts alone to win: on a 2-core CPU, 2 clients of
# the code pair drafted 2-8 tokens a burst of 256, and where the free arm won there they ran
# at 0.89-0.98x plain decoding against 1.01x without it; 8 clients drafted 10 a burst, scored
# 0.98 of not drafting and ran on, at 0.95x. On an H100, the fat 7B pair's lookup drafted 214
# a burst of 256 at 2 clients. The free arm is tried wherever drafting lost with a model: on
# an H200, 2 rows' first drafting epoch (a burst's first 32 rounds, before the text repeats)
# once gained too little for it, 2 rows then decoded plainly and the cell read 0.96x, where
# free drafts, tried on another run, scored 1.68x plain
GAIN_SHARE = 0.05
# a round this many times its epoch's median is a stall, not scored; slower rounds that recur
# (a draft model's steps, a wide verify) sit well under it
STALL = 10.0


PLAIN, FREE, ALL = 0, 1, 2  # the arms: no drafts; drafts that run no draft model; any
ARM_NAMES = {PLAIN: "plain", FREE: "free drafts", ALL: "drafting"}


@dataclass
class _Count:
    """One row count's record: the last score of each arm and the epoch running now."""

    rates: dict[int, float] = field(default_factory=dict)
    arm: int = ALL
    rounds: list[tuple[int, float]] = field(default_factory=list)  # this epoch's (tokens, s)
    costly: bool = False  # a row of this epoch's rounds had a draft model
    gained: int = 0  # tokens this epoch's drafts gained
    free: int = 0  # of them, free drafts'
    distinct: bool = False  # the last drafting epoch had a model row: free drafts differ
    lenient: bool = True  # the last drafting epoch's drafts gained: it runs on within FLOOR
    free_gained: bool = True  # the last free epoch's drafts gained: it may win
    since: dict[int, int] = field(default_factory=dict)  # a loser's: winner's epochs since it ran
    retry: dict[int, int] = field(default_factory=dict)  # a loser's: epochs before its next trial
    trial: bool = False  # the epoch running now tries a loser again
    # the arms scored at this row count itself; rates without any are another row count's
    # (`_borrow`), rescaled at the first score here
    scored: set[int] = field(default_factory=set)


@dataclass
class SpecGate:
    counts: dict[int, _Count] = field(default_factory=dict)

    def level(self, rows: int) -> int:
        """What a batch of `rows` rows may draft now: `ALL`, `FREE` or `PLAIN` (always `ALL`
        with the floor off: `MLXD_SPEC_FLOOR=0`). A row count not yet compared starts from
        the verdict of the nearest one that was (`_borrow`)."""
        if not floor_on():
            return ALL
        c = self._count(rows)
        if not c.rates:  # nothing scored here yet: not even a borrowed record
            c = self._borrow(rows) or c
        return c.arm

    def allows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows may draft anything now."""
        return self.level(rows) != PLAIN

    def rate(self, rows: int, arm: int) -> float | None:
        """The last score of an arm at `rows` rows: committed tokens a second."""
        return self._count(rows).rates.get(arm)

    def record(
        self,
        rows: int,
        tokens: int,
        seconds: float,
        costly: bool = False,
        gained: int = 0,
        free: int = 0,
    ) -> None:
        """A round of `rows` rows (the same rows as the round before) that committed `tokens`
        in `seconds`, return to return; `costly`: some row of it has a draft model; `gained`:
        the tokens of them accepted from drafts, `free` of those from drafts that ran no
        model."""
        c = self._count(rows)
        c.rounds.append((tokens, seconds))
        c.costly = c.costly or costly
        c.gained += gained
        c.free += free
        if len(c.rounds) < EPOCH_ROUNDS:
            return
        arm = c.arm
        first = arm not in c.rates  # this arm's first score
        judged = first or c.trial
        rate, stalls = _score(c.rounds)
        if c.rates and not c.scored:  # borrowed rates, in this row count's tokens a second
            scale = rate / max(c.rates[arm], 1e-9)
            c.rates = {a: r * scale for a, r in c.rates.items()}
        c.rates[arm] = rate
        c.scored.add(arm)
        share = GAIN_SHARE * sum(t for t, _ in c.rounds)
        if arm == ALL:  # free drafts alone differ only where a row drafted with a model
            c.lenient, c.distinct = c.gained >= share, c.costly
        elif arm == FREE:
            c.free_gained = c.free >= share
        c.rounds, c.costly, c.gained, c.free = [], False, 0, 0
        c.arm = self._next(c, arm, first)
        if judged or stalls:  # a comparison, or rounds left out: rare enough to log each
            log.info(
                "speculation gate: %d rows, %s scored %.1f tok/s (%d stalled rounds left out);"
                " %s runs next",
                rows, ARM_NAMES[arm], c.rates[arm], stalls, ARM_NAMES[c.arm],
            )  # fmt: skip

    def _next(self, c: _Count, arm: int, first: bool) -> int:
        if PLAIN not in c.rates:
            return PLAIN  # the baseline, once
        winner = _winner(c.rates, c.lenient, c.free_gained)
        tried, c.trial = c.trial, False
        if tried:  # a loser, tried again: its record says how long until its next try
            last = c.retry.get(arm, RETRY_EPOCHS)
            c.retry[arm] = RETRY_EPOCHS if arm == winner else min(2 * last, MAX_RETRY_EPOCHS)
        if winner == PLAIN and FREE not in c.rates and c.distinct:
            return FREE  # drafting lost: would its free drafts alone pay?
        if first or tried:
            for loser in c.rates:
                c.retry.setdefault(loser, RETRY_EPOCHS)
                if first:  # the comparison starts every loser's clock; a trial, its own
                    c.since[loser] = 0
            return winner
        due = []
        for loser in c.rates:
            if loser != winner:
                c.since[loser] = c.since.get(loser, 0) + 1
                if c.since[loser] >= c.retry.setdefault(loser, RETRY_EPOCHS):
                    due.append(loser)
        if not due:
            return winner
        loser = max(due, key=lambda a: (c.since[a] - c.retry[a], -a))
        c.since[loser], c.trial = 0, True
        return loser

    def _borrow(self, rows: int) -> _Count | None:
        """Start row count `rows` from the record of the nearest row count where the arms
        were compared, within a quarter of `rows` (at least one row; the larger of two as
        near): its winner runs first, its losers are tried after `RETRY_EPOCHS` of its
        epochs here. A batch whose rows come and go (a client's next request arriving after
        its last ended) spends rounds at row counts that never run an epoch's worth of
        rounds; starting each with drafting spent them on the arm that lost at the row count
        beside it. Farther apart, what pays can differ (on an H200, fat 7B pair, free drafts
        ran at 1.68x plain decoding at 2 rows and about even at 8): those start afresh.
        None where no row count near enough was compared."""
        reach = max(1, rows // 4)
        compared = [
            n
            for n, c in self.counts.items()
            if abs(n - rows) <= reach and PLAIN in c.scored and len(c.scored) > 1
        ]
        if not compared:
            return None
        near = self.counts[min(compared, key=lambda n: (abs(n - rows), -n))]
        c = self.counts[rows] = _Count(
            rates=dict(near.rates),
            arm=_winner(near.rates, near.lenient, near.free_gained),
            distinct=near.distinct,
            lenient=near.lenient,
            free_gained=near.free_gained,
        )
        return c

    def _count(self, rows: int) -> _Count:
        c = self.counts.get(rows)
        if c is None:
            c = self.counts[rows] = _Count()
        return c


def _winner(rates: dict[int, float], lenient: bool = True, free_gained: bool = True) -> int:
    """The best of the drafting arms that qualify: drafting within `FLOOR` of plain decoding
    where its drafts gained (`lenient`: its stretches that pay are worth a little), else at
    plain decoding's rate or better; free drafts alone only at plain decoding's rate or
    better and where they gained (`free_gained`: they are tried because drafting lost, so an
    even score is more likely noise than a stretch that pays: on a 2-core CPU, where a
    batch's drafts do not pay, two runs of 2 clients of the code pair that took them ran at
    0.89x and 0.98x of plain decoding greedy, against 1.01x twice without the arm); else
    plain decoding."""
    plain = rates[PLAIN]
    bars = {ALL: FLOOR * plain if lenient else plain, FREE: plain}
    arms = (FREE, ALL) if free_gained else (ALL,)
    fit = [a for a in arms if a in rates and rates[a] >= bars[a]]
    return max(fit, key=lambda a: (rates[a], -a)) if fit else PLAIN


def _score(rounds: list[tuple[int, float]]) -> tuple[float, int]:
    """Tokens a second over an epoch's rounds, its stalls left out; and how many were."""
    limit = STALL * statistics.median(s for _, s in rounds)
    kept = [(t, s) for t, s in rounds if s <= limit]
    rate = sum(t for t, _ in kept) / max(sum(s for _, s in kept), 1e-9)
    return rate, len(rounds) - len(kept)
