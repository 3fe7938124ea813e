"""A lone row's next verify round queued on a guess, before the round in flight is read.

A verify round read before anything is queued after it leaves the device idle while the host
reads the verdict, looks up the next drafts and builds the next forward, and the host idle
while the device finishes: every round pays a lone forward's cost, `v(width)`, where a
pipelined plain step pays only `plain`. Where the round in flight accepts every draft, the next
round's input is known before the host reads it: the target's choice after the last draft
(still on the device) and prompt lookup's continuation of the drafts (`DraftSource.follow`).
So the next forward is queued on that guess first, then the verdict is read. If every draft
was accepted the queued round stands, and its verdict is read the same way a round later;
else it is taken off the cache, unread. Nothing a guess feeds is committed unverified: a
guessed round's drafts are verified against the target's own choices at their positions, which
are fixed (keyed by position) whatever the guess was, so the output is plain decoding's.

Whether to guess is priced from the costs measured at load. A guess that stands saves the
round's wait for the device (`tail`: a lone forward's cost beyond a pipelined step's); one
that fails costs the guessed forward's pipelined cost, less that same wait, during which the
host would have been idle. The round guesses where its drafts' chance of all being accepted
(the controller's estimate) makes the saving outweigh the loss. `MLXD_GUESS=0` never guesses,
`MLXD_GUESS=1` always does where a guess can be made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from mlxd.engine.speculation import Costs

MODE = os.environ.get("MLXD_GUESS", "auto").strip().lower()  # "auto", "0" or "1"


@dataclass(frozen=True)
class Guessed:
    """A verify round queued before the round ahead of it was read."""

    drafts: list[int]  # its drafts, after its first token (the choice the round ahead ends on)
    source: str
    chosen: mx.array  # the target's choices at its 1 + len(drafts) positions, lazy
    # what the round ahead must commit for the drafts to follow it as guessed: its drafts,
    # then the token lookup predicted after them
    expect: list[int]

    @property
    def width(self) -> int:
        return 1 + len(self.drafts)


def tail(costs: Costs) -> float:
    """Seconds a forward waited for alone costs beyond a pipelined step: what a queued round
    saves."""
    return max(0.0, costs.v(1) - costs.plain)


def pays(costs: Costs, all_accepted: float, width: int) -> bool:
    """Whether to queue the next round, `width` tokens wide, on a guess that stands with
    probability `all_accepted`."""
    if MODE in ("0", "off", "false"):
        return False
    if MODE in ("1", "on", "true"):
        return True
    saved = tail(costs)
    if saved <= 0.0:
        return False
    lost = max(costs.v(width) - 2.0 * saved, 0.0)
    return all_accepted * saved >= (1.0 - all_accepted) * lost


def pipelined(costs: Costs, width: int) -> float:
    """What a queued verify round of `width` tokens costs by the measured costs: a lone
    forward's, less the wait it does not have."""
    return max(costs.plain, costs.v(width) - tail(costs))
