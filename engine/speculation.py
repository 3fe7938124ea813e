"""Adaptive draft length: how many tokens to draft this round, from what it costs and pays.

Acceptance is estimated per draft position (a Beta prior updated by every round). For a draft
length k, a round commits E(k) = 1 + sum_j prod_{i<=j} a_i tokens and costs k draft steps plus
one (k+1)-token verify, all measured at probe-open time. The controller picks the k with the best
tokens per second and turns speculation off for the request once even the best k loses to plain
decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Costs:
    """Seconds per forward, measured on this machine: target by width, draft per token."""

    verify: dict[int, float]  # width L -> seconds of one L-token target forward
    draft_step: float = 0.0  # seconds of one single-token draft forward (0: no draft model)

    def v(self, width: int) -> float:
        """Cost of a `width`-token verify; widths never measured borrow the next wider one."""
        if width in self.verify:
            return self.verify[width]
        wider = [w for w in self.verify if w >= width]
        if wider:
            return self.verify[min(wider)]
        widest = max(self.verify)
        return self.verify[widest] * width / widest


@dataclass
class SpecStats:
    """What speculation did for one request (reported in the final response)."""

    method: str = "off"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)  # drafts that reached position i
    accepted_at: list[int] = field(default_factory=list)
    fallback_reason: str | None = None
    disabled_reason: str | None = None

    def observe(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += proposed
        self.accepted += accepted
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [
            round(a / p, 4) if p else 0.0
            for a, p in zip(self.accepted_at, self.proposed_at, strict=False)
        ]


class DraftLengthController:
    """Chooses k per round; `off` once the best k is no better than plain decoding."""

    def __init__(
        self,
        costs: Costs,
        max_k: int,
        draft_cost: float,
        prior: float = 0.7,
        prior_weight: float = 2.0,
        patience: int = 4,
        min_gain: float = 1.02,
    ) -> None:
        self.costs = costs
        self.max_k = max_k
        self.draft_cost = draft_cost
        self.a0 = prior * prior_weight
        self.b0 = (1.0 - prior) * prior_weight
        self.hits = [0.0] * max_k
        self.tries = [0.0] * max_k
        self.patience = patience
        self.min_gain = min_gain
        self.losing = 0
        self.off = max_k <= 0

    def alpha(self, i: int) -> float:
        return (self.a0 + self.hits[i]) / (self.a0 + self.b0 + self.tries[i])

    def expected_rate(self, k: int) -> float:
        """Expected committed tokens per second of a round with k drafts."""
        expected, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.alpha(i)
            expected += survive
        return expected / (k * self.draft_cost + self.costs.v(k + 1))

    def choose(self) -> int:
        if self.off:
            return 0
        plain = self.expected_rate(0)
        best_k = max(range(1, self.max_k + 1), key=self.expected_rate)
        if self.expected_rate(best_k) < plain * self.min_gain:
            self.losing += 1
            if self.losing >= self.patience:
                self.off = True
            return 0 if self.off else best_k
        self.losing = 0
        return best_k

    def observe(self, proposed: int, accepted: int) -> None:
        for i in range(min(proposed, self.max_k)):
            self.tries[i] += 1
            if i < accepted:
                self.hits[i] += 1
