"""Adaptive draft length: how many tokens to draft this round, from what it costs and pays.

Acceptance is estimated per draft position (a Beta prior updated by every round). For a draft
length k, a round commits E(k) = 1 + sum_j prod_{i<=j} a_i tokens and costs k draft steps plus
one (k+1)-token verify, all measured at probe-open time. The controller picks the k with the best
tokens per second and turns speculation off for the request once even the best k loses to plain
decoding.

The search is one pass over the positions (O(k)), and k never exceeds MAX_DRAFT_TOKENS whatever
a request asks for: a round drafts k tokens and verifies k+1, so an unbounded k would let one
request hold its pairing's thread for as long as it liked.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field

from mlxd.registry.bounds import MAX_DRAFT_TOKENS


@dataclass(frozen=True)
class Costs:
    """Seconds per forward, measured on this machine: target by width, draft per token."""

    verify: dict[int, float]  # width L -> seconds of one L-token target forward
    draft_step: float = 0.0  # seconds of one single-token draft forward (0: no draft model)
    plain_step: float = 0.0  # seconds per token of plain (pipelined) decoding; 0: use v(1)
    recompute_rate: float = 0.0  # bytes of K/V per second a cold prefill produces; 0: unknown
    # rows B -> seconds of one B-row single-token draft forward (a batched draft step)
    draft_batch: dict[int, float] = field(default_factory=dict)
    # tokens n -> m: the target's projections run n-token forwards as m-token ones
    # (`engine.rowpad`); `verify` holds the costs as padded
    padded: dict[int, int] = field(default_factory=dict)

    @property
    def plain(self) -> float:
        return self.plain_step or self.v(1)

    def v(self, width: int) -> float:
        """Cost of a `width`-token verify; widths never measured borrow the next wider one."""
        if width in self.verify:
            return self.verify[width]
        wider = [w for w in self.verify if w >= width]
        if wider:
            return self.verify[min(wider)]
        widest = max(self.verify)
        return self.verify[widest] * width / widest

    def branches(self, width: int, most: int, slack: float = 0.1) -> int:
        """How many branches of `width` tokens one verify forward takes (`engine.branches`),
        up to `most`: as many as cost at most `slack` more than one branch alone. Where the
        verify curve is flat (a GPU's launch-bound forwards), several; where every token
        costs (a CPU), one."""
        alone = self.v(width)
        count = 1
        while count < most and self.v((count + 1) * width) <= alone * (1.0 + slack):
            count += 1
        return count

    def draft_rows(self, rows: int) -> float:
        """Cost of one draft step for `rows` rows drafting together: measured row counts
        interpolated, linear past the largest; unmeasured, `rows` single-row steps (what
        drafting row by row costs)."""
        table = self.draft_batch
        if rows <= 0:
            return 0.0
        if not table:
            return self.draft_step * rows
        if rows in table:
            return table[rows]
        below = [r for r in table if r < rows]
        above = [r for r in table if r > rows]
        if not above:
            widest = max(table)
            return table[widest] * rows / widest
        hi = min(above)
        if not below:
            return table[hi]
        lo = max(below)
        return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)


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
    paused: int = 0  # times the clock paused speculation for a while
    filled: int = 0  # a batch round's free slots filled with weaker guesses (`Draft.filler`)
    filled_accepted: int = 0
    behind: int = 0  # rounds queued behind the token in flight (`Generation._round_behind`)

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

    def drop_accepted(self, n: int, of: int) -> None:
        """The last round's final `n` of its `of` accepted drafts were cut off (the row ended
        before them)."""
        if n <= 0:
            return
        self.accepted -= n
        for i in range(of - n, of):
            self.accepted_at[i] -= 1

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


@dataclass
class SourceRecord:
    """Decayed sums over earlier requests for one draft source."""

    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    spec_seconds: float = 0.0  # wall time of speculative rounds, as measured
    plain_seconds: float = 0.0  # what plain decoding would have spent on the same tokens


@dataclass
class PauseClock:
    """Plain tokens until a source that stopped paying is tried again, counted across requests:
    a per-request pause would buy every short request its own losing trial."""

    length: int = 0  # the current pause; doubles after each failed trial (0: not running)
    left: int = 0  # plain tokens still to decode before the next trial


class SpecHistory:
    """What speculation did on one pairing in earlier requests, per draft source.

    A request starts from it: acceptance by position becomes the prior instead of a guess, and a
    source whose rounds recently committed tokens slower than plain decoding waits out the
    pairing's pause clock before its next trial.
    """

    def __init__(self, decay: float = 0.7, max_tries: float = 32.0) -> None:
        self.decay = decay
        self.max_tries = max_tries
        self._lock = threading.Lock()
        self._by_source: dict[str, SourceRecord] = {}
        self._clocks: dict[str, PauseClock] = {}

    def pause_left(self, source: str, start: int) -> int:
        """Plain tokens before the next trial; starts a pause of `start` if none is running."""
        with self._lock:
            clock = self._clocks.setdefault(source, PauseClock())
            if clock.length == 0:
                clock.length = clock.left = start
            return clock.left

    def pausing(self, source: str) -> bool:
        """Whether a pause is running for `source`."""
        with self._lock:
            clock = self._clocks.get(source)
            return clock is not None and clock.length > 0 and clock.left > 0

    def hold(self, source: str, tokens: int) -> None:
        """A pause of `tokens` for `source`, whatever ran before."""
        with self._lock:
            self._clocks[source] = PauseClock(tokens, tokens)

    def spend(self, source: str, tokens: int) -> None:
        """A request decoded `tokens` plain tokens of the pause."""
        with self._lock:
            clock = self._clocks.get(source)
            if clock is not None:
                clock.left = max(0, clock.left - tokens)

    def lengthen(self, source: str, base: int, cap: int) -> int:
        """A trial did not pay: the next pause is twice the last (at least `base`, at most
        `cap`); returns it."""
        with self._lock:
            clock = self._clocks.setdefault(source, PauseClock())
            clock.length = min(max(2 * clock.length, base), cap)
            clock.left = clock.length
            return clock.length

    def clear(self, source: str) -> None:
        """Speculation paid: no pause."""
        with self._lock:
            self._clocks.pop(source, None)

    def get(self, source: str) -> SourceRecord | None:
        with self._lock:
            rec = self._by_source.get(source)
            if rec is None:
                return None
            return SourceRecord(
                list(rec.hits), list(rec.tries), rec.spec_seconds, rec.plain_seconds
            )

    def record(self, source: str, seen: SourceRecord) -> None:
        with self._lock:
            rec = self._by_source.setdefault(source, SourceRecord())
            d = self.decay
            n = max(len(rec.tries), len(seen.tries))

            def padded(xs: list[float]) -> list[float]:
                return xs + [0.0] * (n - len(xs))

            rec.hits = [h * d + x for h, x in zip(padded(rec.hits), padded(seen.hits), strict=True)]
            rec.tries = [
                t * d + x for t, x in zip(padded(rec.tries), padded(seen.tries), strict=True)
            ]
            if rec.tries and rec.tries[0] > self.max_tries:  # a prior, never a certainty
                scale = self.max_tries / rec.tries[0]
                rec.hits = [h * scale for h in rec.hits]
                rec.tries = [t * scale for t in rec.tries]
            rec.spec_seconds = rec.spec_seconds * d + seen.spec_seconds
            rec.plain_seconds = rec.plain_seconds * d + seen.plain_seconds


@dataclass
class RoundClock:
    """Decayed sums over timed speculative rounds: wall seconds, what the cost model says the
    same rounds cost (their drafts and verify widths, at the acceptance they really had), and
    the tokens they committed."""

    seconds: float = 0.0
    modelled: float = 0.0
    tokens: float = 0.0
    weight: float = 0.0
    rounds: int = 0

    def add(self, seconds: float, modelled: float, tokens: int, decay: float) -> None:
        self.seconds = self.seconds * decay + seconds
        self.modelled = self.modelled * decay + modelled
        self.tokens = self.tokens * decay + tokens
        self.weight = self.weight * decay + 1.0
        self.rounds += 1

    def slower(self, plain: float, floor: float) -> float:
        """How much slower than plain decoding these rounds commit tokens (> 1: losing), by
        the wall clock or by the cost model, whichever says worse: the clock sees host and
        launch overheads the model misses, the model sees a loss the clock's noise hides."""
        if not self.tokens:
            return 0.0
        return max(self.seconds, self.modelled) / self.tokens * floor / plain

    def excess(self, plain: float) -> float:
        """Plain steps these rounds took beyond what plain decoding would for their tokens."""
        return max(self.seconds, self.modelled) / plain - self.tokens


FREE_SOURCES = ("lookup", "forced")  # sources whose drafts cost no forward
MODEL_ARM = "model"  # the arm of a mixed source (auto) judged on its own rounds
HELD_ARM = "#" + MODEL_ARM  # a history key's suffix: the pause after that arm lost
# A draft model's trial is skipped where its best expected rate, at the acceptance seen over
# this many rounds, is below this share of plain decoding's (`hopeless`). On an H200 the fat
# 7B/0.5B pair's draft step costs 0.59 of a target step and a verify forward 1.5, so the draft
# pays only above about 0.9 acceptance; sampled at 0.7 it accepted 0.44, drafted 1.7% of the
# tokens and still ran at 0.95x of plain decoding.
KNOWN_TRIES = 16
HOPELESS = 0.8
# A lost trial of a source whose record loses is repaid by the pause after it: at least its loss
# in plain steps over this share (a trial 7 steps behind pauses 350 tokens), so trials cost under
# 2% of the tokens however often a losing source is tried; doubling alone spent 3.6-4.6% on a
# CPU's 4-bit pair, sampled, where prompt lookup's 16-token rounds cost 5 steps and committed
# 3.2 tokens.
TRIAL_SHARE = 0.02


def floor_on() -> bool:
    """Whether speculation that stops paying is paused (the default). `MLXD_SPEC_FLOOR=0`
    keeps every source drafting whatever it costs: for measuring a draft's acceptance, and
    for tests that pin drafting itself rather than its speed."""
    return os.environ.get("MLXD_SPEC_FLOOR", "1") != "0"


class DraftLengthController:
    """Chooses k per round; `off` once speculation no longer pays.

    The cost model picks k; the clock decides whether speculation stays on: once speculative
    rounds commit tokens slower than plain decoding does (by the wall clock, or by the cost
    model at the acceptance they really had; by a margin that shrinks as rounds add up), it
    turns off. Forward costs alone mislead on launch-bound GPUs, where a lazily chained draft
    and verify overlap. A source of several arms (`auto`) is also judged arm by arm: an arm
    that runs a draft model and loses turns it off (the source then continues with its
    cheaper arm), even while the free arm's wins hide that loss in the mix.
    """

    def __init__(
        self,
        costs: Costs,
        max_k: int,
        draft_cost: float,
        prior: float = 0.7,
        prior_weight: float = 4.0,
        explore: float = 0.3,
        patience: int = 4,
        floor: float = 0.98,
        decay: float = 0.95,
        doubt: float = 0.15,
        pause_tokens: int = 16,
        max_pause: int = 1024,
        model_pause: int = 256,
        history: SpecHistory | None = None,
        source: str = "",
        regime: str = "",
        free_k: int | None = None,
    ) -> None:
        """`free_k`: the most drafts per round once the source drafts at no cost (`auto`
        continuing with prompt lookup, `restart`); None: `max_k`.
        With a `history` in which `source` did not pay lately (in this sampling `regime`),
        the request waits out the pairing's pause clock first (`off` at once; a source with a
        cheaper arm runs that). A source that runs a draft model (`draft_cost` > 0) pauses for
        at least `model_pause` tokens, and up to 4x `max_pause`: each of its trials pays for
        the draft reading the prompt, which only a long pause amortizes."""
        self.costs = costs
        self.max_k = max_k = min(max_k, MAX_DRAFT_TOKENS)
        self.free_k = max_k if free_k is None else min(free_k, MAX_DRAFT_TOKENS)
        self.draft_cost = draft_cost
        self.explore = explore
        self.a0 = prior * prior_weight
        self.b0 = (1.0 - prior) * prior_weight
        self.hits = [0.0] * max_k
        self.tries = [0.0] * max_k
        self.patience = patience
        self.off = max_k <= 0
        self.floor = floor
        self.decay = decay
        self.doubt = doubt  # how much slower than plain a few rounds must look to stop
        self.judged = False  # this trial already cleared the backoff
        self.benches = 0  # batch rounds in a row that verified none of this row's drafts
        self.bench_pauses = 0  # pauses since the batch last verified this row's drafts
        self.clock = RoundClock()  # this trial's timed rounds
        self.arms: dict[str, RoundClock] = {}  # the same, per arm that drafts with a model
        self.pending_seconds = 0.0  # draft prefill time, charged to the next timed round
        if draft_cost > 0:
            pause_tokens = max(pause_tokens, model_pause)
            max_pause *= 4
        self.pause_tokens = pause_tokens  # plain tokens before speculation is tried again
        self.base_pause = pause_tokens
        self.backoff = 0  # the last pause after a lost trial (0: none since the last paid one)
        self.max_pause = max_pause
        self.history = history
        self.regime = regime
        key = self.key = f"{source}/{regime}" if regime else source
        self.seen = SourceRecord()  # this request's own rounds, for the history
        self.prior_hits = [0.0] * max_k
        self.prior_tries = [0.0] * max_k
        self._bests: dict[tuple[int, float], tuple[int, float]] = {}  # `_best`, until `observe`
        past = history.get(key) if history is not None else None
        if past is not None:
            for i in range(min(max_k, len(past.tries))):
                self.prior_hits[i], self.prior_tries[i] = past.hits[i], past.tries[i]
            assert history is not None
            if past.spec_seconds * floor > past.plain_seconds > 0:
                start = pause_tokens if draft_cost > 0 else 4 * pause_tokens
                left = history.pause_left(key, start=start)
                # it did not pay lately: wait out the pause, then a trial
                self.off = left > 0 and floor_on()
                self.pause_tokens = left or pause_tokens
            elif history.pausing(key + HELD_ARM) and floor_on():
                # its record pays (its free arm wins) but its draft-model arm lost lately: the
                # free arm runs until that pause ends (each request used to try the losing arm)
                self.off = True
                self.pause_tokens = history.pause_left(key + HELD_ARM, start=0)
            if not self.off and floor_on() and self.hopeless():
                self.skip_trial()  # a trial due now would lose: wait a longer pause instead

    def paused_for(self, tokens: int) -> None:
        """`tokens` were decoded plainly during a pause (all of it, or the request ended)."""
        if self.history is not None:
            self.history.spend(self.key, tokens)
            self.history.spend(self.key + HELD_ARM, tokens)

    def resume(self) -> None:
        """Try speculation again after a pause: a trial, judged after `patience` rounds. What
        was learned about acceptance is kept; the timing starts afresh."""
        self.off = False
        self.clock = RoundClock()
        self.arms = {}
        self.judged = False

    def benched(self) -> None:
        """The batch this row decodes in verified none of its drafts this round: its measured
        costs say they would not pay there. After `patience` such rounds in a row, the row
        stops paying for a source it does not use (a draft model catching up, rounds that
        cannot be pipelined): it pauses, for the base pause and then twice as long each time
        the batch declines it again (up to the longest pause; a round that verifies its
        drafts starts over). The pairing's pause clock is left alone: the batch, not the
        source, is what does not pay."""
        self.benches += 1
        if self.benches >= self.patience and floor_on():
            self.benches = 0
            self.off = True
            self.pause_tokens = min(self.base_pause << self.bench_pauses, self.max_pause)
            self.bench_pauses = min(self.bench_pauses + 1, 16)

    def _stop_paying(self, arm_lost: bool = False) -> None:
        """A trial lost: the next pause is twice the last (the pairing's clock when shared),
        and, where the source's record loses, long enough to repay what the trial lost
        (`TRIAL_SHARE`). `arm_lost`: the loss was the draft-model arm's, whose pause later
        requests wait out on the free arm."""
        self.off = True
        repay = 0
        if self._record_loses():
            repay = math.ceil(max(self.clock.excess(self.costs.plain), 0.0) / TRIAL_SHARE)
        least = max(self.base_pause, repay)
        if self.history is not None:
            self.backoff = self.history.lengthen(self.key, least, self.max_pause)
        else:
            self.backoff = min(max(2 * self.backoff, least), self.max_pause)
        self.pause_tokens = self.backoff
        if arm_lost and self.history is not None:
            self.history.hold(self.key + HELD_ARM, self.backoff)

    def _record_loses(self) -> bool:
        """Whether this source's rounds, this request's and the pairing's before it, commit
        tokens slower than plain decoding would: only then must the pause repay a lost trial
        (a source that pays now and then, prompt lookup's greedy copies, would miss its next
        win waiting out a long one: on this CPU greedy lookup fell from 1.34x to 1.27x)."""
        spec, plain = self.seen.spec_seconds, self.seen.plain_seconds
        past = self.history.get(self.key) if self.history is not None else None
        if past is not None:
            spec, plain = spec + past.spec_seconds, plain + past.plain_seconds
        return spec * self.floor > plain

    def _paid(self) -> None:
        """A trial was judged and paid: the backoff starts over."""
        self.backoff = 0
        if self.history is not None:
            self.history.clear(self.key)

    def restart(self, draft_cost: float, source: str) -> DraftLengthController:
        """A fresh controller for a cheaper draft source on the same target (one that drafts
        at no cost may draft up to `free_k`)."""
        self.conclude()
        max_k = self.free_k if draft_cost == 0 else self.max_k
        return DraftLengthController(
            self.costs, max_k, draft_cost, patience=self.patience,
            history=self.history, source=source, regime=self.regime, free_k=self.free_k,
        )  # fmt: skip

    def conclude(self) -> None:
        """Hand what this request saw to the pairing's history (once)."""
        if self.history is not None and (self.seen.tries or self.seen.spec_seconds):
            self.history.record(self.key, self.seen)
        self.seen = SourceRecord()

    def alphas(self, k: int, optimistic: bool = False) -> list[float]:
        """Acceptance at positions 0..k-1, given the previous ones were accepted. A position's
        prior is the estimate of the one before it, so positions never tried inherit what was
        seen instead of a fixed guess. `optimistic` adds a bonus that shrinks with the tries, so
        one early rejection cannot pin k low for the rest of the request: to the positions
        tried and the first one past them, not to every untried one behind it, whose bonuses
        would multiply (a first round then verified 15 lookup drafts at 0.99 each; on a CPU,
        where 16 tokens cost 3.4 plain steps, a sampled request's trial lost 22%)."""
        out: list[float] = []
        weight = self.a0 + self.b0
        prior_a = self.a0
        frontier = True  # the position before this one was tried (or this is the first)
        for i in range(k):
            seen = i < len(self.tries)  # past max_k (free drafts of `auto`): never tried
            hits = self.hits[i] + self.prior_hits[i] if seen else 0.0
            tries = self.tries[i] + self.prior_tries[i] if seen else 0.0
            mean = (prior_a + hits) / (weight + tries)
            bonus = self.explore / math.sqrt(1.0 + tries) if optimistic and frontier else 0.0
            out.append(min(mean + bonus, 0.99))
            prior_a = mean * weight
            frontier = tries > 0
        return out

    def alpha(self, i: int) -> float:
        return self.alphas(i + 1)[i]

    def expected_rate(self, k: int) -> float:
        """Expected committed tokens per second of a round with k drafts."""
        expected, survive = 1.0, 1.0
        for a in self.alphas(k, optimistic=True):
            survive *= a
            expected += survive
        return expected / (k * self.draft_cost + self.costs.v(k + 1))

    def choose(self) -> int:
        """The k of the best `expected_rate` (0 while off)."""
        return 0 if self.off else self.wanted()

    def wanted(self) -> int:
        """The k of the best `expected_rate` were speculation on (what a paused row will ask
        for once it resumes)."""
        return self._best()[0]

    def free_wanted(self) -> int:
        """The k of the best `expected_rate` were drafts free, up to `free_k`: an `auto` row
        where only its prompt lookup may draft (a batch's free level) drafts as far as a
        lookup row would, not its draft model's length."""
        return self._best(self.free_k, 0.0)[0]

    def _best(self, most: int | None = None, draft_cost: float | None = None) -> tuple[int, float]:
        """The k (up to `most`, default `max_k`) of the best `expected_rate` at `draft_cost`
        (default the source's) and that rate, in one pass: E(k) extends E(k-1) by one term.
        Kept until the next `observe`: a row asks before every step, and between rounds its
        plain steps would recompute it on the host while the device waits (0.1 ms a step on
        a 2-core CPU)."""
        most = self.max_k if most is None else most
        cost = self.draft_cost if draft_cost is None else draft_cost
        found = self._bests.get((most, cost))
        if found is None:
            found = self._bests[(most, cost)] = self._best_of(most, cost)
        return found

    def _best_of(self, most: int, cost: float) -> tuple[int, float]:
        best_k, best_rate = 1, -1.0
        expected, survive = 1.0, 1.0
        for k, a in enumerate(self.alphas(most, optimistic=True), start=1):
            survive *= a
            expected += survive
            rate = expected / (k * cost + self.costs.v(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def hopeless(self) -> bool:
        """Whether a draft model's trial is known to lose before it runs: its acceptance has
        been seen over at least `KNOWN_TRIES` rounds (this request's and the pairing's), and
        at that acceptance, exploration bonus included, no k's expected rate reaches
        `HOPELESS` of plain decoding's. A trial costs the draft reading the context and
        `patience` losing rounds; the margin keeps a cost model that is somewhat off from
        skipping trials that would win by the wall clock."""
        if self.draft_cost <= 0 or not self.tries:
            return False
        if self.tries[0] + self.prior_tries[0] < KNOWN_TRIES:
            return False
        return self._best()[1] * self.costs.plain < HOPELESS

    def skip_trial(self) -> None:
        """A trial `hopeless` says loses is not run: it counts as lost (a longer pause)."""
        self._stop_paying()

    def observe(self, proposed: int, accepted: int) -> None:
        """Count position i as tried only when every draft before it was accepted: the
        estimates are acceptance given the previous positions' (what `alphas` multiplies).
        Counting every proposed position would square the falloff and undervalue long drafts."""
        seen = self.seen
        self._bests.clear()
        reached = min(proposed, accepted + 1, self.max_k)
        while len(seen.tries) < reached:
            seen.tries.append(0.0)
            seen.hits.append(0.0)
        for i in range(reached):
            self.tries[i] += 1
            seen.tries[i] += 1
            if i < accepted:
                self.hits[i] += 1
                seen.hits[i] += 1

    @property
    def weight(self) -> float:
        return self.clock.weight

    @property
    def timed_rounds(self) -> int:
        return self.clock.rounds

    def charge(self, seconds: float) -> None:
        """Time the source spent outside rounds (reading the prompt), borne by the next round."""
        self.pending_seconds += seconds

    def observe_time(
        self,
        seconds: float,
        committed: int,
        drafted: int = 0,
        arm: str = "",
        modelled: float | None = None,
    ) -> None:
        """A speculative round's wall time, how many tokens it committed, how many it drafted
        (0: judge by the wall clock alone), which arm of the source drafted them, and what
        the cost model says the round cost (default: a lone row's k drafts and verify)."""
        plain = self.costs.plain
        seconds += self.pending_seconds
        self.pending_seconds = 0.0
        # One round that compiled a new kernel shape must not condemn speculation for good.
        seconds = min(seconds, 4.0 * plain * max(committed, 1))
        if modelled is None:
            modelled = 0.0
            if drafted:
                draft_cost = 0.0 if arm in FREE_SOURCES else self.draft_cost
                modelled = drafted * draft_cost + self.costs.v(drafted + 1)
        self.seen.spec_seconds += max(seconds, modelled)
        self.seen.plain_seconds += plain * committed
        self.clock.add(seconds, modelled, committed, self.decay)
        self.benches = 0
        if drafted:
            self.bench_pauses = 0
        losing = self._losing(self.clock)
        arm_lost = False
        if drafted and arm == MODEL_ARM and not self.key.startswith(MODEL_ARM):
            own = self.arms.setdefault(arm, RoundClock())
            own.add(seconds, modelled, committed, self.decay)
            arm_lost = self._losing(own)
        if (losing or arm_lost) and floor_on():
            self._stop_paying(arm_lost)
        elif (
            self.clock.rounds >= self.patience
            and not self.judged
            and self.clock.slower(plain, self.floor) <= 1.0
        ):  # the trial's verdict: it pays
            self.judged = True
            self._paid()

    def _losing(self, clock: RoundClock) -> bool:
        """Whether these rounds, past `patience`, commit tokens slower than plain decoding.
        A round commits 1..k+1 tokens, so a few rounds are a noisy sample: stopping on a short
        unlucky run costs a pause where speculation pays. The margin shrinks as rounds add up."""
        if clock.rounds < self.patience or not clock.tokens:
            return False
        slower = clock.slower(self.costs.plain, self.floor)
        return slower > 1.0 + self.doubt / math.sqrt(clock.weight)


class FixedDraftLength(DraftLengthController):
    """Always k drafts and never off: for warm-up, benchmarks at a given k, and tests."""

    def __init__(self, costs: Costs, k: int) -> None:
        super().__init__(costs, k, 0.0)

    def choose(self) -> int:
        return self.max_k

    def wanted(self) -> int:
        return self.max_k

    def observe_time(
        self,
        seconds: float,
        committed: int,
        drafted: int = 0,
        arm: str = "",
        modelled: float | None = None,
    ) -> None:
        return None
