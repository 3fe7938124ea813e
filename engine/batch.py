"""Rows decoding together: one target forward per round over every row, speculation included.

The rows' K/V live in one batch cache per layer (mlx-lm's `BatchKVCache`: rows left-padded to
one write position, per-row offsets for RoPE and the mask). A round right-pads each row's input
[pending, drafts...] to the widest row, runs one forward, and every row accepts against its own
logits with its own position-keyed randomness (`verify`). Afterwards each row keeps exactly its
accepted length: the batch trims what no row kept, and a row that kept less is rolled right by
the difference (`prepare(right_padding=...)` + `finalize()`, as mlx-lm does for right-padded
prompts), so its rejected positions become left padding the mask already hides. A round where
no row drafts is plain batched decoding (width 1, the path the CUDA ragged-attention kernel
serves).

Per-row K/V lists stacked anew each round would copy every cache every token; the batch cache
copies a row only when it joins (merge, extend) or leaves (extract, filter), and rolls only in
rounds whose rows accepted different lengths.

Rows drafting with the draft model draft together (`engine.draftbatch`): their draft K/V sit in
the draft's own batch cache, joined when a row first drafts in the batch and handed back to
the row's source when it leaves, and each draft step is one forward over all of them. Rows
drafting otherwise (lookup, grammar-forced tokens, penalties that need each draft on the host)
propose on their own.

Rounds where no row drafts are pipelined as a lone row's plain decoding is: the next round's
forward is queued on the tokens this round chose, still on the device, before the host reads
them, so the device never waits for the host's per-row work (`Ahead`). The choice at every
position is keyed by the position, so a round computed ahead chooses exactly what it would
have chosen later, and the round after it runs plainly even when a row has found a draft
since (as a lone row's does). A verify round queues the round after it the same way where
every row decodes that one plainly. A row joining or leaving first takes the round ahead back
off the cache (one position for every row).

How many drafts a round verifies is one choice for the batch: a width W costs one forward of
B x W tokens, estimated as the target's measured cost of a B*W-token forward (`Costs.v`, linear past
the widest measured width: conservative), plus the draft steps: W forwards of the draft batch
(`Costs.draft_rows`, measured per row count) and each other row's own. The batch picks the W
with the most expected committed tokens per second, W = 1 (plain) included, so speculation backs
off as rows are added exactly where it stops paying; a round it plans plain runs as a plain
round (no verify machinery, the next one queued where it can be). Each drafting row's controller
then judges the round's wall time, as a lone row's does (`_judge`): a row whose drafts lose in
the batch pauses or stops, whatever the planner expected.

The probe's costs are single forwards, timed alone; a served batch's rounds are not. Its plain
rounds are pipelined (the host's work hides under the device's), and its verify rounds are not
and carry every row's per-round host work. On an H200 serving an 8B model to 8 clients, rounds
planned from the probe's costs alone ran at 0.78x of plain decoding. So the batch times its own
rounds, return to return (`RoundTimes`): plain rounds in their pipelined steady state by row
count, verify rounds by row count and width. The planner and the judge price a round by what
this batch measured, the probe's curve filling in what it has not run yet (scaled to the plain
rounds it measured), so the first verify round at a shape is a trial and later ones are judged
by their record (the median of its recent rounds, so one stalled round does not condemn a width;
dropped now and then, so that a width once timed as losing is tried again).

A verify round read before the next is queued keeps the device waiting while the host reads
it: on an H200, fat 7B pair, 2 rows x 9 tokens took 20.7 ms where a queued 2-row plain round
took 7.2. Where prompt lookup drafts, the next round is queued as a verify round too, before
this one is read: each row's first token is its choice after what this round accepted (found
on the device), its drafts prompt lookup's, run on the device after what this round commits
(`engine.devicelookup`), so they follow the row's text whatever the round accepts. (With
`MLXD_FILLERS=0` the host guesses them instead: lookup's continuation of what the round would
commit if it accepted every draft, `DraftSource.follow`; a wrong guess costs the round's
drafts, never a token.) A sampled row's choices take the noise of the positions they land on
(picked on the device), so a seeded row commits what it does alone. Such rounds are priced by
their own record, return to return, as plain rounds are (`RoundTimes.queued`).

A verify round computes every row's slots up to its width, whatever they hold, so a row with
fewer drafts than the width fills the rest (`Draft.filler`): in a round read before the next
is queued, with prompt lookup's continuation on the host, down to one token's match (`filled`,
`DraftSource.filler`); in one queued before, with the device's lookup as far as the round
reaches. A filler accepted is a token for nothing; no plan counts on them and no acceptance
estimate learns from them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxd.engine import kvcache, lora_cuda
from mlxd.engine.adapters import selecting
from mlxd.engine.devicelookup import WINDOW, device_lookup
from mlxd.engine.draftbatch import DraftBatch, base_of, cut_padding, trim_rows
from mlxd.engine.drafting import Draft, ModelDraftSource
from mlxd.engine.generation import Generation
from mlxd.engine.grammar import Walk
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng, choose_rows, sample_keyed, to_ints
from mlxd.engine.specgate import FREE, SpecGate
from mlxd.engine.speculation import FREE_SOURCES, Costs
from mlxd.engine.verify import Verdict, choices, decide

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """The next round, queued: its rows and (a plain round) their chosen tokens, still lazy.
    `steady`: queued by a plain round, so its round times the batch's pipelined steady state
    (one queued by a verify round started early and is not timed as one; queued `unread`, what
    it takes beyond or short of a steady round is that verify round's). A verify round queued on
    guessed drafts (`RowBatch._queue_guessed`) holds them (`drafts`, `width` tokens a row)
    and each row's choices at every position; `expect[i]`: how many tokens row i holds, and
    what they end with, once the round before commits what the guess assumed."""

    gens: list[Generation]
    tokens: mx.array | None  # None: a verify round on guesses (its choices are `chosen`)
    steady: bool = True
    unread: bool = False  # queued by a verify round before its verdicts were read
    drafts: list[Draft] | None = None
    chosen: list[mx.array] | None = None
    width: int = 1
    expect: list[tuple[int, list[int]] | None] | None = None
    # drafts looked up on the device: how many of each row's a lookup match of two tokens
    # or more found (`device_lookup`), which its plan's drafts are cut to once read
    found: mx.array | None = None
    inputs: mx.array | None = None  # (rows, width): each row's next token, then its drafts
    picks: mx.array | None = None  # (rows, width): the choices, where every row is greedy


@dataclass
class Committed:
    """What one row committed in a round, or why it could not (`error`: that row's own state
    refused its tokens, e.g. its grammar; the batch's other rows go on)."""

    gen: Generation
    tokens: list[int]
    error: Exception | None = None


def _absorbed(
    g: Generation,
    draft: Draft,
    verdict: Verdict,
    walked: Walk | None = None,
    logits: mx.array | None = None,
) -> Committed:
    """Row `g`'s commit of a round; a failure is that row's alone (`Committed.error`)."""
    try:
        return Committed(g, g.absorb(draft, verdict, walked, logits))
    except Exception as exc:
        return Committed(g, [], exc)


def expected_tokens(gen: Generation, k: int) -> float:
    """Tokens a row expects to commit from a round with k drafts (1 when k = 0), at the
    acceptance its controller expects, without the bonus a lone row explores with: in a batch
    an exploratory round costs every row a wider forward (on a CPU, 4 and 8 clients of the
    code pair ran at 0.90-0.93x of plain decoding greedy with it, 0.94-1.00x without; one run
    each)."""
    if k <= 0 or gen.controller is None:
        return 1.0
    expected, survive = 1.0, 1.0
    for a in gen.controller.alphas(k, optimistic=False):
        survive *= a
        expected += survive
    return expected


def draft_seconds(
    gens: Sequence[Generation],
    ks: Sequence[int],
    costs: Costs,
    paid: Sequence[bool] | None = None,
) -> float:
    """What drafting ks[i] tokens for each row costs: rows whose draft model drafts batched
    share its steps (one B-row forward each, `draft_rows`); any other row pays its own.
    `paid[i]`: whether row i's drafts this round run its draft model (`pays_drafts`), where
    known (a row of `auto` whose prompt lookup covers the round drafts for free)."""
    alone, shared = 0.0, []
    for i, (g, n) in enumerate(zip(gens, ks, strict=True)):
        if not n or (paid is not None and not paid[i]):
            continue
        if g.drafts_batched:
            shared.append(n)
        elif g.controller is not None:
            alone += n * g.controller.draft_cost
    return alone + max(shared, default=0) * costs.draft_rows(len(shared))


def pays_drafts(gen: Generation, n: int) -> bool:
    """Whether the row's next n drafts cost draft steps: its source runs a draft model for
    them (a lookup hit of `auto` does not; a failing source is priced as paying)."""
    if n <= 0 or gen.source is None or _drafts_free(gen):
        return False
    try:
        return gen.source.runs_model(gen.tokens, n)
    except Exception:
        return True


def free_want(gen: Generation, want: int, flight: int = 0) -> int:
    """Row `gen`'s drafts where only free ones may run (`specgate.FREE`), for a round after
    `flight` tokens not yet committed: none that would run its draft model, and an `auto`
    row's prompt-lookup hit as long as a lookup row's (`DraftLengthController.free_wanted`),
    not cut to its draft model's length: there its lookup drafts alone."""
    if not want or pays_drafts(gen, want):
        return 0
    ctl, source = gen.controller, gen.source
    if ctl is None or source is None or _drafts_free(gen):
        return want
    k = min(ctl.free_wanted(), gen.limit - gen.produced - flight - 1)
    return max(want, len(source.follow(gen.tokens, k)))


def guessed_tokens(gen: Generation, k: int, prior: int) -> float:
    """Tokens a row expects from a round on k guessed drafts (`RowBatch._queue_guessed`):
    the guess is lookup's continuation of what the round in flight commits if it accepts
    its `prior` drafts and the next token is the one lookup predicts, so the drafts count
    only at the chance of that; else the round commits its first token, as a plain one."""
    if k <= 0 or gen.controller is None:
        return 1.0
    on_track = 1.0
    ctl = gen.controller
    for a in ctl.alphas(min(prior + 1, len(ctl.hits)), optimistic=False):
        on_track *= a
    return 1.0 + on_track * (expected_tokens(gen, k) - 1.0)


def _drafts_free(gen: Generation) -> bool:
    """Whether the row's drafts cost no draft step (prompt lookup, forced tokens)."""
    return gen.controller is not None and gen.controller.draft_cost == 0


ROUND_DECAY = 0.7  # weight of the estimate so far when a plain round's time is added
ROUND_CAP = 4.0  # a round timed past this many times its modelled cost counts as this many
RETRY_ROUNDS = 2048  # plain rounds after which verify rounds' records are dropped (re-tried)
VERIFY_SAMPLES = 5  # the recent verify rounds of a shape whose median prices it
SLOW_ROUND = 0.25  # seconds: a round this slow, and SLOW_RATIO times its modelled cost, is logged
SLOW_RATIO = 10.0
# rows up to which a batch queues verify rounds on guessed drafts: on an H200 (fat 7B pair,
# greedy, 128 tokens a stream, `bench/concurrency.py --pairing`) they ran at 1.41x plain
# decoding with 2 rows and 1.26-1.34x with 4, but 0.83-0.86x with 8, whose plain rounds
# serve more rows for the host's encoding of one forward than a wider forward gains (with the
# host's guesses; with drafts looked up on the device an H100 read 1.09x and 0.61x greedy at 8
# rows on two machine starts, 0.94x sampled; `MLXD_GUESS_ROWS` sets it)
GUESS_ROWS = int(os.environ.get("MLXD_GUESS_ROWS", "4"))


# whether a verify round fills each row's slots past its drafts, up to the round's width, with
# its source's weaker guesses (`DraftSource.filler`), and a round queued before the one in
# flight is read looks its drafts up on the device (`_looked_up`); `MLXD_FILLERS=0`: neither
# (slots left padding, the host's guesses)
FILLERS = os.environ.get("MLXD_FILLERS", "1") != "0"


def fills(g: Generation) -> bool:
    """Whether row `g` fills a round's free slots: it has a source to guess from and its
    choices need nothing read between forwards."""
    return FILLERS and g.source is not None and g.plain_only and not g.done


def filled(g: Generation, d: Draft, width: int) -> Draft:
    """Row `g`'s draft `d` with the rest of a round of `width` filled from its source's
    `filler`: the round computes those slots whatever they hold, so a filler accepted is a
    token for nothing and one rejected costs nothing. Only rows whose drafts are on the host
    (none, or prompt lookup's) and whose choices need nothing read between forwards; never
    past the row's limit."""
    source = g.source
    if source is None or not fills(g):
        return d
    if d.count and d.source not in FREE_SOURCES:
        return d  # a draft model's tokens are still on the device
    room = min(width - 1 - d.count, g.limit - g.produced - d.count - 1)
    if room <= 0:
        return d
    drafted = to_ints(d.tokens) if d.count else []
    try:
        fill = source.filler(g.tokens + drafted, room)[:room]
    except Exception:  # a source that fails its drafts is stopped where it drafts
        return d
    if not fill:
        return d
    tokens = mx.array(drafted + fill, dtype=mx.uint32)
    return Draft(tokens, d.count + len(fill), d.source or "lookup", d.filler + len(fill))


def round_widths(draft_tokens: int, free_tokens: int) -> tuple[int, ...]:
    """The verify widths a batch runs where shapes compile (a GPU): every width up to a draft
    model's default round (`draft_tokens` + 1), each power of two plus one (free drafts cut
    shorter, `plan_widths`) and the longest free round (`free_tokens` + 1). Load runs each of
    them for every row count (`warm_rounds`), and a round of another width is padded up to the
    next of them, so no round meets a shape the serving thread has not run."""
    widths = set(range(1, draft_tokens + 2)) | {free_tokens + 1}
    widths |= {(1 << i) + 1 for i in range(free_tokens.bit_length()) if 1 << i < free_tokens}
    return tuple(sorted(widths))


def padded_width(width: int, widths: Sequence[int] | None) -> int:
    """The narrowest of `widths` (sorted) that holds `width` tokens; `width` itself where any
    width runs (None) or none holds it."""
    if widths is None:
        return width
    return next((w for w in widths if w >= width), width)


@dataclass
class RoundTimes:
    """Wall seconds of a batch's rounds, return to return: plain rounds in their pipelined
    steady state by row count (a moving average: they come every round), verify rounds by (rows,
    width), drafting included. Where shapes compile (`compiles`: a GPU) the first verify round
    of a shape is not recorded (it compiled the shape); on a CPU it is, as on this 2-core CPU a
    lookup burst of 2 clients ran 3 verify rounds of 56-60 ms (4.6 plain rounds) and would price
    its first two by the probe's curve alone. Any round counts at most `ROUND_CAP` times its
    modelled cost. A width whose record says it loses is not run again, so one slow round (a
    stall on the device, another thread's work) must not make that record: a shape is priced by
    the median of its last `VERIFY_SAMPLES` rounds, or, with fewer than three on record, by the
    fastest of them (with one, also no slower than the probe's curve says), so that a width is
    declined on two slow rounds, not one. A shape not yet on record is priced by the probe's
    curve times how this batch's verify rounds of every shape measured against it (`excess`,
    robust as a shape's record is), so that once verify rounds are known to cost more than the
    probe says (on a CPU, served 8x5 verify rounds cost 4.3 plain rounds), each other shape is
    not tried at a loss to learn it again. A verify round that queued nothing after it is also
    charged what the plain round after it, run fresh, took beyond a queued one (`hold_verify`,
    `add_fresh`): that is what the verify round cost the pipeline. Every `RETRY_ROUNDS` plain
    rounds the verify records are dropped and the widths tried anew."""

    costs: Costs
    compiles: bool = True  # a shape's first forward compiles (a GPU): its first round unpriced
    plain: dict[int, float] = field(default_factory=dict)
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    queued: dict[tuple[int, int], float] = field(default_factory=dict)  # guessed rounds
    _samples: dict[tuple[int, int], deque[float]] = field(default_factory=dict, repr=False)
    _excess: deque[float] = field(
        default_factory=lambda: deque(maxlen=2 * VERIFY_SAMPLES), repr=False
    )
    _tried: set[tuple[int, int]] = field(default_factory=set, repr=False)
    _queued_samples: dict[tuple[int, int], deque[float]] = field(default_factory=dict, repr=False)
    _queued_tried: set[tuple[int, int]] = field(default_factory=set, repr=False)
    _plain_rounds: int = field(default=0, repr=False)
    # a verify round (rows, width, seconds, drafting, queueing) whose next round says its cost
    _held: tuple[int, int, float, float, float] | None = field(default=None, repr=False)

    def plain_round(self, rows: int) -> float:
        """A plain round of `rows` rows: as measured, else the probe's `rows`-token forward."""
        return self.plain.get(rows) or self.costs.v(rows)

    def verify_round(self, rows: int, width: int, drafting: float, queued: bool = False) -> float:
        """A verify round of `rows` x `width` tokens whose drafts cost `drafting`: as measured,
        else the probe's forward scaled as this batch's plain rounds measured against it and
        by the `excess` its verify rounds showed. `queued`: one queued on guessed drafts
        before the round ahead of it was read, pipelined as a plain round is: as measured,
        else the probe's forward scaled as the plain rounds measured."""
        if queued:
            seen = self.queued.get((rows, width))
            return seen if seen is not None else self._modelled(rows, width, drafting)
        probed = self._modelled(rows, width, drafting) * self.excess()
        seen = self.verify.get((rows, width))
        if seen is None:
            return probed
        if len(self._samples.get((rows, width), ())) == 1:
            return min(seen, probed)
        return seen

    def excess(self) -> float:
        """Measured verify rounds over what the probe's curve says they cost: 1 until two are
        on record, then the lesser of two or the median of more."""
        if len(self._excess) < 2:
            return 1.0
        return _robust(self._excess)

    def _modelled(self, rows: int, width: int, drafting: float) -> float:
        """The probe's verify forward and the drafts, scaled as the plain rounds measured."""
        scale = self.plain_round(rows) / max(self.costs.v(rows), 1e-12)
        return (self.costs.v(rows * width) + drafting) * scale

    def add_plain(self, rows: int, seconds: float) -> None:
        _average(self.plain, rows, min(seconds, ROUND_CAP * self.costs.v(rows)))
        self._plain_rounds += 1
        if self._plain_rounds >= RETRY_ROUNDS:
            self._plain_rounds = 0
            self.verify.clear()
            self._samples.clear()
            self._excess.clear()
            self._tried.clear()
            self.queued.clear()
            self._queued_samples.clear()
            self._queued_tried.clear()

    def hold_verify(
        self, rows: int, width: int, seconds: float, drafting: float, queueing: float = 0.0
    ) -> None:
        """A verify round that queued nothing after it, or (`queueing` seconds spent on it)
        queued the next round before reading its verdicts: recorded once that round says what
        it cost (`add_fresh`), else as it is."""
        self.flush()
        self._held = (rows, width, seconds, drafting, queueing)

    def add_fresh(self, rows: int, seconds: float, queued: bool = False) -> None:
        """A plain round of `rows` computed fresh, not queued: right after a held verify round
        of the same rows, what it took beyond a pipelined round is that verify round's (it
        broke the pipeline; on an H200, 4 rows of a 7B: 22.9 ms fresh against 9.1 queued), so
        a verify round is priced with the plain round it unpipelines. `queued`: the round was
        queued by the verify round itself, before its verdicts were read, and that round's
        time holds building it: what it took short of a pipelined round is taken off too, down
        to the verify round's own time."""
        held, self._held = self._held, None
        if held is not None:
            r, width, spent, drafting, queueing = held
            extra = seconds - self.plain_round(rows) if r == rows else 0.0
            if queued:
                spent = max(spent + extra, spent - queueing)
            else:
                spent += max(extra, 0.0)
            self.add_verify(r, width, spent, drafting)

    def flush(self) -> None:
        """Record a held verify round as it is (the next round was no fresh plain round)."""
        held, self._held = self._held, None
        if held is not None:
            self.add_verify(*held[:4])

    def add_verify(self, rows: int, width: int, seconds: float, drafting: float) -> None:
        if self.compiles and (rows, width) not in self._tried:
            self._tried.add((rows, width))
            return
        modelled = self.costs.v(rows * width) + drafting
        kept = min(seconds, ROUND_CAP * modelled)
        samples = self._samples.setdefault((rows, width), deque(maxlen=VERIFY_SAMPLES))
        samples.append(kept)
        self.verify[(rows, width)] = _robust(samples)
        self._excess.append(kept / max(self._modelled(rows, width, drafting), 1e-12))

    def add_queued(self, rows: int, width: int, seconds: float) -> None:
        """A verify round queued on guessed drafts, timed from the previous round's return
        (the first of a shape not: on a GPU it compiles the shape)."""
        key = (rows, width)
        if self.compiles and key not in self._queued_tried:
            self._queued_tried.add(key)
            return
        kept = min(seconds, ROUND_CAP * self._modelled(rows, width, 0.0))
        samples = self._queued_samples.setdefault(key, deque(maxlen=VERIFY_SAMPLES))
        samples.append(kept)
        self.queued[key] = _robust(samples)


def _robust(samples: deque[float]) -> float:
    """A record no one slow sample makes: the least of up to two, the median of more."""
    ordered = sorted(samples)
    return ordered[(len(ordered) - 1) // 2 if len(ordered) > 2 else 0]


def _average(table: dict[Any, float], key: Any, seconds: float) -> None:
    old = table.get(key)
    table[key] = seconds if old is None else ROUND_DECAY * old + (1 - ROUND_DECAY) * seconds


def plan_widths(
    gens: Sequence[Generation],
    wants: Sequence[int],
    costs: Costs,
    times: RoundTimes | None = None,
    widths: Sequence[int] | None = None,
    priors: Sequence[int] | None = None,
) -> list[int]:
    """Drafts per row for this round: the batch-wide width with the best expected rate, each
    round priced as the batch measured it (`times`) or else by the probe's costs, at the width
    it runs as (`padded_width` of the batch's `widths`). The widths tried are the rows' own
    and, below the widest free one, the powers of two: a row's free drafts (prompt lookup) run
    long where a lone row's verify costs little, and may still pay cut shorter in a batch,
    whose verify grows with every row's width. `priors`: the drafts are guesses that follow
    `priors[i]` drafts of the round in flight (`guessed_tokens`), and the round is queued
    before that one is read, free of drafting costs."""
    rows = len(gens)
    times = times if times is not None else RoundTimes(costs)
    best, best_rate = 0, rows / times.plain_round(rows)
    # guesses are lookup's (free); else each row's drafts as its source would make them
    paid = [priors is None and pays_drafts(g, w) for g, w in zip(gens, wants, strict=True)]
    free = max((w for w, p in zip(wants, paid, strict=True) if not p), default=0)
    shorter = {1 << i for i in range(free.bit_length()) if 1 << i < free}
    tried = {w for w in wants if w > 0} | shorter
    if widths:  # no wider than the widest width run
        tried = {min(k, widths[-1] - 1) for k in tried}
    for k in sorted(tried):
        ks = [min(w, k) for w in wants]
        width = padded_width(k + 1, widths)
        if priors is None:
            expected = sum(expected_tokens(g, n) for g, n in zip(gens, ks, strict=True))
            cost = times.verify_round(rows, width, draft_seconds(gens, ks, costs, paid))
        else:
            expected = sum(guessed_tokens(*row) for row in zip(gens, ks, priors, strict=True))
            cost = times.verify_round(rows, width, 0.0, queued=True)
        rate = expected / max(cost, 1e-12)
        if rate > best_rate:
            best, best_rate = k, rate
    return [min(w, best) for w in wants]


class RowBatch:
    """The rows stepped together and their batch cache; rows join and leave between rounds."""

    def __init__(self, target: nn.Module, costs: Costs) -> None:
        self.target = target
        self.costs = costs
        self.gens: list[Generation] = []
        self.cache: list[Any] = []
        self.ahead: Ahead | None = None  # the next plain round, queued (its position written)
        self.drafts: DraftBatch | None = None  # the rows' draft-model K/V, drafting together
        self.times = RoundTimes(costs, compiles=kvcache.bucket_of(target) is not None)
        # whether rows may draft, by row count, as measured: greedy batches apart from those
        # with a sampled row, whose drafts are accepted far less (`gate`)
        self.gates: dict[str, SpecGate] = {}
        self.widths: tuple[int, ...] | None = None  # the verify widths run (`round_widths`)
        self._returned: tuple[float, list[Generation]] | None = None  # last round's end, rows
        self._waited = 0.0  # this round's wait for the device, in its read (`_note_slow`)
        self._gained = [0, 0]  # this round's tokens from drafts, and from free ones (`SpecGate`)

    def __len__(self) -> int:
        return len(self.gens)

    def __contains__(self, gen: Generation) -> bool:
        return any(g is gen for g in self.gens)

    def join(self, gens: Sequence[Generation]) -> None:
        """Move rows' caches into the batch. Each must hold every committed token but the
        last (`Generation.settle`) in plain K/V layers (`Generation.batchable`). A plain round
        queued for the rows already here stays queued where the next round can carry the
        joiners too (`_plain_round`): they decode one round later, and no forward is thrown
        away."""
        if not gens:
            return
        if not self._keeps_ahead_for(gens):
            self.drop_ahead()
        kind = kvcache.batch_type(self.target)
        layers = len(gens[0].cache)
        merged = [kind.merge([g.cache[i] for g in gens]) for i in range(layers)]
        if self.cache:
            for mine, new in zip(self.cache, merged, strict=True):
                mine.extend(new)
        else:
            self.cache = merged
        for g in gens:
            g.cache = []  # the batch holds the row's K/V until it leaves
            self.gens.append(g)

    def _ahead_for_all(self) -> bool:
        """Whether a plain round is queued for every row (a distributed target's batch cache
        replays its calls on other ranks: there a queued round is always taken back)."""
        ahead = self.ahead
        return (
            ahead is not None
            and ahead.drafts is None
            and _same(ahead.gens, self.gens)
            and not getattr(self.cache[0], "adopt_as_is", False)
        )

    def _keeps_ahead_for(self, gens: Sequence[Generation]) -> bool:
        """Whether a round queued for every row here can stay as rows `gens` join: the next
        round queues again for all of them, so every row must decode it plainly."""
        return (
            self._ahead_for_all()
            and all(g.produced + 1 < g.limit for g in self.gens)
            and all(g.plain_only and g.produced < g.limit for g in gens)
            and self._next_is_plain([*self.gens, *gens], bench=False)
        )

    def _next_is_plain(self, gens: Sequence[Generation], bench: bool = True) -> bool:
        """Whether the round after the next drafts nothing for `gens`, as far as the host
        knows now: every row decodes it plainly (`plain_next`), or the rows that may draft
        there (speculation on, or a pause ending: `next_want`) would draft only where the plan
        declines them, priced as `round` prices them. Rows with speculation on are benched now
        (`bench`), as a planned round benches them, and the round can be queued: rows the
        batch will not let draft do not stop it pipelining, nor does a pause that ends into a
        round the plan declines (on a CPU, 4 clients of the code pair ran such a round
        unpipelined, at twice a pipelined round's time, each time a row's pause ended)."""
        maybe = [d and not g.plain_next() for g, d in zip(gens, self._drafting(gens), strict=True)]
        if not any(maybe):
            return True
        wants = self._free_only(
            gens, [g.next_want() if m else 0 for g, m in zip(gens, maybe, strict=True)]
        )
        if any(plan_widths(gens, wants, self.costs, self.times, self.widths)):
            return False
        for g, want in zip(gens, wants, strict=True):
            if bench and want and g.spec.on and g.controller is not None:
                g.controller.benched()
        return True

    def leave(self, gen: Generation) -> None:
        """Give a row its own caches (target and draft) back and drop it from the batch. A
        plain round queued for these rows stays queued for the others (the leaving row's
        position in it comes off its own cache): a row that ends costs the batch no forward.
        On bucketed caches every row's left padding is known from its tokens, so nothing is
        read back from the device."""
        kept_ahead = self._ahead_for_all()
        if not kept_ahead:
            self.drop_ahead()
        part = gen.source.model_part() if gen.source is not None else None
        if part is not None and self.drafts is not None and part in self.drafts:
            self.drafts.leave(part)
        slot = next(i for i, g in enumerate(self.gens) if g is gen)
        extra = int(kept_ahead)  # the queued round's position, in every row
        lengths = [len(g.tokens) - 1 + extra for g in self.gens]  # each row's K/V
        bucketed = isinstance(self.cache[0], kvcache.BucketedBatchKVCache)
        end = self.cache[0]._idx
        own = []
        step = kvcache.bucket_of(self.target)
        for c in self.cache:
            part_kv = c.extract(slot, end - lengths[slot]) if bucketed else c.extract(slot)
            layer = kvcache.own_layer(part_kv, step)
            layer.trim(extra)
            own.append(layer)
        gen.cache = own
        del self.gens[slot]
        ahead, self.ahead = self.ahead, None
        if not self.gens:
            self.cache = []
            return
        keep = [i for i in range(len(lengths)) if i != slot]
        rows = mx.array(keep)
        min_left = end - max(lengths[i] for i in keep)
        for c in self.cache:
            if bucketed:
                c.filter(rows, min_left)
            else:
                c.filter(rows)
        if kept_ahead and ahead is not None and ahead.tokens is not None:
            self.ahead = Ahead(list(self.gens), ahead.tokens[rows], ahead.steady, ahead.unread)

    def round(self) -> list[Committed]:
        """One round for every row: drafts, one verify forward, per-row acceptance and trim;
        scored for the gate on drafting (`SpecGate`) where it follows a round of the same
        rows and some row speculates (rows that never draft would score either arm alike)."""
        since, rows, gate = self._since(), len(self.gens), self.gate(self.gens)
        sources = [g.source for g in self.gens if g.source is not None]
        costly = any(s.model_part() is not None for s in sources)
        self._gained = [0, 0]
        committed = self._round(since)
        returned = self._returned
        if sources and since is not None and returned is not None and returned[0] > since:
            tokens = sum(len(c.tokens) for c in committed)
            gate.record(rows, tokens, returned[0] - since, costly, *self._gained)
        return committed

    def gate(self, gens: Sequence[Generation]) -> SpecGate:
        """The speculation gate of rows `gens`: one for all-greedy batches, one for batches
        with a sampled row. A record carried from one to the other misleads: on an H200, fat
        7B pair, 7 greedy rows drafted at 1.38x plain decoding, and 7 rows sampled at 0.7
        would draft on that record until plain decoding's retry came due (8 epochs)."""
        regime = "greedy" if all(g.opts.greedy for g in gens) else "sampled"
        found = self.gates.get(regime)
        if found is None:
            found = self.gates[regime] = SpecGate()
        return found

    def level(self, gens: Sequence[Generation]) -> int:
        """What rows `gens` may draft now (`SpecGate.level`)."""
        return self.gate(gens).level(len(gens))

    def _drafting(self, gens: Sequence[Generation]) -> list[bool]:
        """Which rows may draft: all where the gate allows it at this row count, else only
        rows whose drafts a grammar forces (free and certain: no gamble to gate)."""
        if self.gate(gens).allows(len(gens)):
            return [True] * len(gens)
        return [g.source is not None and g.source.name.startswith("forced") for g in gens]

    def _free_only(self, gens: Sequence[Generation], wants: list[int]) -> list[int]:
        """The drafts rows want, less those that would run a draft model where the gate
        allows free drafts only (`specgate.FREE`)."""
        if self.level(gens) != FREE:
            return wants
        return [free_want(g, w) for g, w in zip(gens, wants, strict=True)]

    def _round(self, since: float | None) -> list[Committed]:
        gens = self.gens
        self._waited = 0.0
        if self.ahead is not None and self.ahead.drafts is not None:
            return self._guessed_round(since)
        if self.ahead is not None and _leads(self.ahead.gens, gens):
            return self._plain_round(since)  # computed already: a draft found since waits a round
        may = self._drafting(gens)
        wants = [g.draft_length(ready=False) if m else 0 for g, m in zip(gens, may, strict=True)]
        wants = self._free_only(gens, wants)
        t0 = time.perf_counter()
        ks = list(wants)
        if any(wants):
            ks = plan_widths(gens, wants, self.costs, self.times, self.widths)
        readying = 0.0
        for i, (g, want, k) in enumerate(zip(gens, wants, ks, strict=True)):
            if want and not k and g.controller is not None:
                g.controller.benched()
            if k:  # the draft reads the prompt once its drafts are taken, not before
                r0 = time.perf_counter()
                g.ready_source()
                readying += time.perf_counter() - r0
                ks[i] = k if g.spec.on else 0
        # a draft's reading of its prompt is no round's time, counted from either start (the
        # trial pays it once): on an H200, 24 ms of a 59 ms 4 x 2 verify round
        t0 += readying
        since = since + readying if since is not None else None
        if not any(ks) and all(g.plain_only for g in gens):
            return self._plain_round(since)  # no draft wanted, or every one declined: no verify
        self.drop_ahead()
        self.times.flush()  # a verify round follows: the one held ran no fresh plain round
        drafts = self._propose(ks)
        width = padded_width(1 + max(d.count for d in drafts), self.widths)
        drafts = [filled(g, d, width) for g, d in zip(gens, drafts, strict=True)]
        rows = []
        for g, d in zip(gens, drafts, strict=True):
            pending = mx.array([g.tokens[-1]], dtype=mx.uint32)
            pad = mx.full((width - 1 - d.count,), g.tokens[-1], dtype=mx.uint32)
            rows.append(mx.concatenate([pending, d.tokens.astype(mx.uint32), pad]))
        inputs = mx.stack(rows)
        logits = self._logits(inputs)
        walks = [g.walk(d, logits) for g, d in zip(gens, drafts, strict=True)]  # grammar rows
        argmaxed = [
            g.opts.greedy and not g.opts.has_penalties and w is None
            for g, w in zip(gens, walks, strict=True)
        ]
        greedy = mx.argmax(logits, axis=-1).astype(mx.uint32) if any(argmaxed) else None
        chosen = []
        for i, (g, d) in enumerate(zip(gens, drafts, strict=True)):
            if greedy is not None and argmaxed[i]:  # one argmax for every such row
                chosen.append(greedy[i, : 1 + d.count])
                continue
            host = to_ints(d.tokens) if d.count and g.opts.has_penalties else []
            w = walks[i]
            bias = w.bias if w is not None else None
            chosen.append(choices(logits[i, : 1 + d.count], host, g.tokens, g.opts, g.rng, bias))
        picks = greedy if all(argmaxed) else None
        # issued before the next round is queued: read after it, they would otherwise be
        # evaluated inside it, and reading them would wait for the whole of it
        mx.async_eval(chosen, [d.tokens for d in drafts])
        q0 = time.perf_counter()
        unread = self._queue_unread(drafts, chosen, width, [True] * len(gens), inputs, picks)
        queueing = time.perf_counter() - q0  # the next round's work (its time is charged here)
        committed = self._read(drafts, chosen, walks, logits, width, unread)
        end = self._ended(gens)
        seconds = end - (since if since is not None else t0)
        paid = [0 if d.source in FREE_SOURCES else d.scored for d in drafts]
        drafting = draft_seconds(gens, paid, self.costs)
        self._note_slow(len(gens), width, seconds, drafting)
        self._judge(drafts, committed, seconds - queueing, width, drafting)
        if self.ahead is None:  # none queued unread (or taken back): queue one now
            self._queue_after_verify()
        queued = self.ahead is not None and self.ahead.unread
        if width > 1 and (self.ahead is None or queued):  # the next round says what it cost
            self.times.hold_verify(len(gens), width, seconds, drafting, queueing)
        elif width > 1:
            self.times.add_verify(len(gens), width, seconds, drafting)
        return committed

    def _read(
        self,
        drafts: list[Draft],
        chosen: list[mx.array],
        walks: Sequence[Walk | None],
        logits: mx.array | None,
        width: int,
        unread: bool,
        on_track: Sequence[bool] | None = None,
    ) -> list[Committed]:
        """Read a verify round's choices (one host sync for the whole batch), commit each
        row's verdict and keep its K/V (`unread`: the next round was queued before this read).
        A row whose guessed drafts followed a commit that did not happen (`on_track` False)
        commits its tokens as a plain round's: its drafts teach its controller nothing."""
        w0 = time.perf_counter()
        mx.eval(chosen, [d.tokens for d in drafts])
        self._waited = time.perf_counter() - w0
        verdicts = [
            decide(to_ints(d.tokens) if d.count else [], to_ints(c))
            for d, c in zip(drafts, chosen, strict=True)
        ]
        committed = []
        for i, (g, d, v, w) in enumerate(zip(self.gens, drafts, verdicts, walks, strict=True)):
            if on_track is not None and not on_track[i]:
                d = Draft.empty(d.source)
            rows = logits[i] if logits is not None else None
            committed.append(_absorbed(g, d, v, w, rows))
            if d.count:
                gained = max(0, len(committed[-1].tokens) - 1)
                self._gained[0] += gained
                self._gained[1] += gained if d.source in FREE_SOURCES else 0
        # each row keeps the K/V of what it committed, all but the last: 1 + accepted drafts,
        # fewer where EOS or the limit cut its commit (so its K/V length is its tokens' - 1)
        kept = [len(c.tokens) for c in committed]
        if unread:
            self._settle_unread(kept, [1 + v.accepted for v in verdicts], width)
        else:
            self.keep(kept, width)
        return committed

    def _guessed_round(self, since: float | None) -> list[Committed]:
        """The verify round `_queue_guessed` queued: read it, as a verify round is read, after
        queueing the next one on it; timed return to return, as a queued plain round is."""
        ahead, self.ahead = self.ahead, None
        assert ahead is not None and ahead.drafts is not None and ahead.chosen is not None
        assert ahead.expect is not None and ahead.inputs is not None
        assert _same(ahead.gens, self.gens)
        gens, drafts, width = self.gens, ahead.drafts, ahead.width
        t0 = time.perf_counter()
        self.times.flush()  # the verify round before this one queued it: recorded as it is
        on_track = [
            e is None or (len(g.tokens) == e[0] and g.tokens[-len(e[1]) :] == e[1])
            for g, e in zip(gens, ahead.expect, strict=True)
        ]
        # a sampled row off its track chose past its first token with the noise of positions
        # its tokens do not sit at: only that first choice (keyed where it lands) is a choice
        drafts = [
            d if on or g.opts.greedy else Draft.empty(d.source)
            for g, d, on in zip(gens, drafts, on_track, strict=True)
        ]
        unread = self._queue_unread(
            drafts, ahead.chosen, width, on_track, ahead.inputs, ahead.picks
        )
        if ahead.found is not None:  # the plan's drafts the lookup did not find are fillers
            # read once the next round is queued: the host never waits on the device first
            drafts = [
                replace(d, filler=d.count - min(d.scored, n))
                for d, n in zip(drafts, to_ints(ahead.found), strict=True)
            ]
        walks = [None] * len(gens)
        committed = self._read(drafts, ahead.chosen, walks, None, width, unread, on_track)
        end = self._ended(gens)
        seconds = end - (since if since is not None else t0)
        self._note_slow(len(gens), width, seconds)
        judged = [d if on else Draft.empty() for d, on in zip(drafts, on_track, strict=True)]
        self._judge(judged, committed, seconds, width, 0.0)
        if since is not None:
            self.times.add_queued(len(gens), width, seconds)
        if self.ahead is None:
            self._queue_after_verify()
        return committed

    def _queue_unread(
        self,
        drafts: list[Draft],
        chosen: list[mx.array],
        width: int,
        on_track: list[bool],
        inputs: mx.array,
        picks: mx.array | None = None,
    ) -> bool:
        """Where shapes compile (a GPU, whose decode steps are bound by the host's encoding),
        keep each row's accepted K/V and queue the plain round after this verify round before
        the host reads the verdicts, so the device computes that round while the host reads,
        streams and plans: on an H200, fat 7B pair, a 4-row verify round took 25 ms where a
        queued 4-row plain round took 9.5 and a fresh 3-row one 24. Each row's accepted count is
        found on the device as `decide` finds it on the host (drafts equal to the target's
        choices, up to the first that differs), the next input is the choice after them and
        what the rows rejected rolls into their left padding (`drop_unread`); a sampled row's
        next choice takes the noise of the position it lands on (`_choose_unread`). Where the
        rows' sources can guess their next drafts, that round is a verify round on them
        (`_queue_guessed`; `on_track[i]`: row i's `drafts` follow what it has committed).
        `inputs`: the round's (rows, width); `picks`: its choices as one grid, where every
        row's are its row of it (greedy rows). Whether the round qualifies (nothing queued
        where it does not)."""
        gens = self.gens
        if not (
            isinstance(self.cache[0], kvcache.BucketedBatchKVCache)
            and all(g.plain_only for g in gens)
            and any(g.produced + 1 < g.limit for g in gens)
        ):
            return False
        kept, nexts = _unread_verdicts(drafts, chosen, width, inputs, picks)
        kvcache.BucketedBatchKVCache.drop_unread(self.cache, width - kept)
        if self._queue_guessed(drafts, nexts, on_track, kept, width, inputs):
            return True
        logits = self._forward(nexts[:, None], queued=True)
        queued = self._choose_unread(logits, kept, width)
        mx.async_eval(queued)
        self.ahead = Ahead(list(gens), queued, steady=False, unread=True)
        return True

    def _queue_guessed(
        self,
        drafts: list[Draft],
        nexts: mx.array,
        on_track: list[bool],
        kept: mx.array | None = None,
        flight: int = 1,
        inflight: mx.array | None = None,
    ) -> bool:
        """Queue the next round as a verify round before this one (of `flight` tokens a row)
        is read, where the batch holds at most `GUESS_ROWS` rows, some row's text is being
        copied and the plan says its drafts pay over a plain round (`plan_widths` with
        `priors`). Each row's input is its choice after this round's accepted drafts
        (`nexts`, on the device; a plain round's choice), then its drafts: with `FILLERS`,
        prompt lookup's on the device after what this round commits (`_looked_up`), filling
        the round; else the host's guess of lookup's continuation of what this round commits
        if it accepts every draft (`_guess`). A sampled row's choices take the noise of the
        positions they land on, picked on the device by the `kept[i]` tokens this round
        commits (`_choose_unread`; a plain round, `flight` 1, commits one); a host guess's
        later choices take the keys of the positions they take if the guess is on track, the
        only case in which they count (`_guessed_round`). On bucketed caches only, whose
        rows roll by counts the host has not read."""
        gens = self.gens
        if not (
            len(gens) <= GUESS_ROWS
            and self.gate(gens).allows(len(gens))
            and isinstance(self.cache[0], kvcache.BucketedBatchKVCache)
            and all(g.plain_only for g in gens)
        ):
            return False
        guesses = None
        if FILLERS:  # drafts looked up on the device, after what the round in flight commits
            wants = [self._forecast(g, flight) for g in gens]
            priors = [0] * len(gens)
        else:
            guesses = [
                self._guess(g, d, on) for g, d, on in zip(gens, drafts, on_track, strict=True)
            ]
            wants = [len(x[0]) if x is not None else 0 for x in guesses]
            priors = [len(x[1]) - 1 if x is not None else 0 for x in guesses]
        if not any(wants):
            return False
        ks = plan_widths(gens, wants, self.costs, self.times, self.widths, priors)
        if not any(ks):
            return False
        width = padded_width(1 + max(ks), self.widths)
        expect: list[tuple[int, list[int]] | None] = [None] * len(gens)
        found = None
        firsts = nexts.reshape(-1, 1)
        if guesses is None:
            guessed, grid, found = self._looked_up(nexts, kept, flight, width, ks, inflight)
            # a row's slots past its drafts hold what its lookup found there (or 0): the
            # round reads no choice from them, and each row keeps only what it commits
            inputs = mx.concatenate([firsts, grid], axis=1)
        else:
            guessed = [Draft.empty()] * len(gens)
            for i, (g, x, k) in enumerate(zip(gens, guesses, ks, strict=True)):
                if x is not None and k:
                    guessed[i] = Draft(mx.array(x[0][:k], dtype=mx.uint32), k, "lookup")
                    expect[i] = (len(g.tokens) + len(x[1]), x[1])
            pads = [mx.zeros((width - 1 - d.count,), dtype=mx.uint32) for d in guessed]
            padded = [
                mx.concatenate([d.tokens.astype(mx.uint32), p])
                for d, p in zip(guessed, pads, strict=True)
            ]
            inputs = mx.concatenate([firsts, mx.stack(padded)], axis=1)
        logits = self._logits(inputs, queued=True)
        greedy = None  # the greedy rows' choices, one argmax for all
        if any(g.opts.greedy for g in gens):
            greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
        chosen = []
        for i, (g, d, e) in enumerate(zip(gens, guessed, expect, strict=True)):
            if greedy is not None and g.opts.greedy:
                chosen.append(greedy[i, : 1 + d.count])
                continue
            if d.count and e is None:  # looked up after where the round in flight leaves it
                block = g.rng.keys(len(g.tokens) + 1, flight + d.count)
                at = mx.arange(1 + d.count) + (kept[i] - 1 if kept is not None else 0)
                chosen.append(sample_keyed(logits[i, : 1 + d.count], g.opts, block[at]))
                continue
            first = g.rng.keys(len(g.tokens) + 1, flight)  # where the round in flight leaves it
            keys = [mx.take(first, kept[i] - 1, axis=0)[None] if kept is not None else first]
            if d.count and e is not None:
                keys.append(g.rng.keys(e[0] + 1, d.count))
            chosen.append(sample_keyed(logits[i, : 1 + d.count], g.opts, mx.concatenate(keys)))
        # the lookup's counts and drafts with the round (before its forward), so reading them
        # waits for nothing the next round queues behind
        mx.async_eval(*([found] if found is not None else []), chosen, [d.tokens for d in guessed])
        picks = greedy if all(g.opts.greedy for g in gens) else None
        self.ahead = Ahead(
            list(gens), None, False, True, guessed, chosen, width, expect, found, inputs, picks
        )
        return True

    def _forecast(self, g: Generation, flight: int) -> int:
        """Drafts row `g` asks for in a round queued before the one in flight (of `flight`
        tokens) is read, its drafts looked up on the device: what its controller wants where
        lookup continues its text now (a copy goes on past the round in flight), else none;
        at the gate's free level, as far as a lookup row would (`free_want`)."""
        if not g.spec.on or g.source is None or g.controller is None:
            return 0
        k = min(g.spec.draft_length(g.produced), g.limit - g.produced - flight - 1)
        found = len(g.source.follow(g.tokens, k)) if k > 0 else 0
        if found and self.level(self.gens) == FREE:
            return free_want(g, found, flight)
        return found

    def _looked_up(
        self,
        nexts: mx.array,
        kept: mx.array | None,
        flight: int,
        width: int,
        ks: list[int],
        inflight: mx.array | None,
    ) -> tuple[list[Draft], mx.array, mx.array | None]:
        """Each row's drafts for a round of `width` queued before the round in flight is
        read (its inputs `inflight`, (rows, flight), each row's drafts after its first input;
        it commits `kept[i]` tokens, the last `nexts[i]`), looked up on the device after what
        it commits (`device_lookup`): as many as the round holds, never past the row's limit,
        the first `ks[i]` the plan's and the rest fillers (the plan's cut, once read, to what
        a lookup match of two tokens or more found: the third value, on the device). The
        second is every row's lookup, (rows, width - 1)."""
        gens = self.gens
        on = [fills(g) for g in gens]
        if not any(on):
            empty = mx.zeros((len(gens), width - 1), dtype=mx.uint32)
            return [Draft.empty() for _ in gens], empty, None
        drafted_before = mx.zeros((len(gens), 0), dtype=mx.uint32)
        counts = mx.ones((len(gens),), dtype=mx.int32)
        if inflight is not None and kept is not None:  # a verify round in flight
            drafted_before, counts = inflight[:, 1:], kept
        windows = [g.tokens[-WINDOW:] if o else [] for g, o in zip(gens, on, strict=True)]
        found, drafted = device_lookup(
            windows, drafted_before, counts, nexts.reshape(-1), width - 1
        )
        out = []
        for i, (g, o, k) in enumerate(zip(gens, on, ks, strict=True)):
            room = min(width - 1, g.limit - g.produced - flight - 1) if o else 0
            if room <= 0:
                out.append(Draft.empty())
                continue
            out.append(Draft(found[i, :room], room, "lookup", filler=room - min(k, room)))
        return out, found, drafted

    def _guess_after(self, tokens: mx.array) -> bool:
        """Queue a verify round on guessed drafts after a plain round that chose `tokens`."""
        rows = len(self.gens)
        return self._queue_guessed([Draft.empty()] * rows, tokens, [True] * rows)

    def _guess(self, g: Generation, d: Draft, on_track: bool) -> tuple[list[int], list[int]] | None:
        """Row `g`'s drafts for the round after this one, and what they assume this round
        commits past its tokens now (its drafts, where `on_track`, then the token the source
        predicts after them); None where it has none: speculation not on, drafts from a
        draft model (not on the host before the round is read) or near its limit. (With
        `FILLERS`, rows look their drafts up on the device instead: `_looked_up`.)"""
        if not g.spec.on or g.source is None or g.controller is None:
            return None
        if d.count and on_track and d.source not in FREE_SOURCES:
            return None
        prior = to_ints(d.tokens) if d.count and on_track else []
        k = min(g.spec.draft_length(g.produced), g.limit - g.produced - len(prior) - 2)
        if k <= 0:
            return None
        follow = g.source.follow(g.tokens + prior, k + 1)
        if len(follow) < 2:
            return None
        return follow[1:], [*prior, follow[0]]

    def _choose_unread(self, logits: mx.array, kept: mx.array, width: int) -> mx.array:
        """Each row's token (B,) after a verify round of `width` whose commits `kept` the host
        has not read: a sampled row's noise is the key of the position it lands on, picked on
        the device from the keys of every position the round could have left it at."""
        gens = self.gens

        def key_of(i: int) -> mx.array:
            g = gens[i]
            return mx.take(g.rng.keys(len(g.tokens) + 1, width), kept[i] - 1, axis=0)[None]

        return choose_rows(logits, [g.opts for g in gens], key_of)

    def _settle_unread(self, kept: list[int], accepted: list[int], width: int) -> None:
        """After `_queue_unread`, once the verdicts are read: where a row committed less than
        it accepted (an end of sequence or its limit among the drafts), the queued round is
        taken back and the row's surplus trimmed, leaving the cache as `keep` leaves it; else
        the rows' shared left padding is cut as `keep` cuts it, reckoned from their tokens (a
        read of the device would wait for the queued round)."""
        surplus = [a - k for a, k in zip(accepted, kept, strict=True)]
        if any(surplus):
            self.drop_ahead()
            trim_rows(self.cache, surplus, len(self.gens))
        elif any(k < width for k in kept):
            # each row holds every committed token but the last, and the queued round's
            queued = self.ahead.width if self.ahead is not None else 1
            least = self.cache[0]._idx - max(len(g.tokens) for g in self.gens) - (queued - 1)
            cut_padding(self.cache, len(self.gens), least)

    def _queue_after_verify(self) -> None:
        """Queue the round after a verify round where every row decodes it plainly, as a plain
        round queues the next: the host's work on this round's tokens (streaming them, the
        scheduler's turn) then runs while the device computes it, and the round is not run
        unpipelined."""
        gens = self.gens
        if not all(g.plain_only for g in gens) or all(g.done for g in gens):
            return
        if not self._next_is_plain(gens):
            return
        last = mx.array([[g.tokens[-1]] for g in gens], dtype=mx.uint32)
        tokens = self._choose(self._forward(last), [0] * len(gens))
        mx.async_eval(tokens)
        self.ahead = Ahead(list(gens), tokens, steady=False)

    def _note_slow(self, rows: int, width: int, seconds: float, drafting: float = 0.0) -> None:
        """Log a round far slower than its shape costs (a stall: a shape compiled inside the
        round, another thread's work), with its shape and how long its read waited for the
        device (the rest passed on the host: building, encoding, the scheduler's work since the
        last round), so a slow spell can be traced."""
        if seconds <= SLOW_ROUND:
            return
        modelled = self.costs.v(rows * width) + drafting
        if seconds > SLOW_RATIO * modelled:
            log.warning(
                "slow round: %d rows x %d tokens took %.0f ms (its shape costs %.1f ms; its read"
                " waited %.0f ms for the device)",
                rows, width, seconds * 1e3, modelled * 1e3, self._waited * 1e3,
            )  # fmt: skip

    def untimed(self) -> None:
        """Work other than rounds runs before the next round: that round is not timed."""
        self._returned = None

    def _since(self) -> float | None:
        """When the previous round returned, if it was these same rows' (else None)."""
        returned = self._returned
        if returned is None or not _same(returned[1], self.gens):
            return None
        return returned[0]

    def _ended(self, gens: list[Generation]) -> float:
        now = time.perf_counter()
        self._returned = (now, list(gens))
        return now

    def _judge(
        self,
        drafts: list[Draft],
        committed: list[Committed],
        seconds: float,
        width: int,
        drafting: float,
    ) -> None:
        """Each drafting row's controller judges the round as a lone row's judges its own, by
        what the whole batch committed: the round's time (by the wall clock and by the cost
        model) is shared out per committed token and scaled so that a plain round of these
        rows costs one plain step a token. A row whose drafts pay for itself but not for the
        rows padded to its width pauses, as a lone row whose drafts lose does. `drafting` is
        what the cost model says the round's drafts cost."""
        rows, total = len(self.gens), sum(len(c.tokens) for c in committed)
        if not total:
            return
        modelled = self.costs.v(rows * width) + drafting
        per_token = rows * self.costs.plain / max(self.times.plain_round(rows), 1e-12) / total
        for d, c in zip(drafts, committed, strict=True):
            ctl, n = c.gen.controller, len(c.tokens)
            if d.scored and ctl is not None and c.gen.spec.on:
                share = per_token * n
                ctl.observe_time(seconds * share, n, d.scored, d.source, modelled * share)

    def _plain_round(self, since: float | None = None) -> list[Committed]:
        """A round where no row drafts, pipelined: the next one is queued before this one's
        tokens are read, when every row will decode it plainly too. One that was queued is
        timed (from `since`, the previous round's return) as the batch's plain round. Rows
        that joined after it was queued (`join`) commit nothing this round: the next one,
        queued now for every row, carries their first token. It is queued while any row goes
        on: a row that ends with this round leaves with its position in it taken off its own
        cache (`leave`), so the others keep their pipelining. Where rows can guess their
        drafts, it is queued as a verify round on them (`_queue_guessed`)."""
        gens = self.gens
        ahead, self.ahead = self.ahead, None
        late: list[Generation] = []
        pipelined = False
        if ahead is not None and ahead.tokens is not None and _leads(ahead.gens, gens):
            tokens, late = ahead.tokens, gens[len(ahead.gens) :]
            pipelined = not late and ahead.steady
        else:
            if ahead is not None:
                self._take_back(ahead.width)
            last = mx.array([[g.tokens[-1]] for g in gens], dtype=mx.uint32)
            tokens = self._choose(self._forward(last), [0] * len(gens))
            mx.async_eval(tokens)
        if late:
            pending = mx.array([g.tokens[-1] for g in late], dtype=mx.uint32)
            inputs = mx.concatenate([tokens, pending])[:, None]
            queued = self._choose(
                self._forward(inputs, queued=True), [1] * len(tokens) + [0] * len(late)
            )
            mx.async_eval(queued)
            self.ahead = Ahead(list(gens), queued)
        elif (
            any(g.produced + 1 < g.limit for g in gens)
            and not self._guess_after(tokens)
            and self._next_is_plain(gens)
        ):
            queued = self._choose(self._forward(tokens[:, None], queued=True), [1] * len(gens))
            mx.async_eval(queued)
            self.ahead = Ahead(list(gens), queued)
        w0 = time.perf_counter()
        chosen = to_ints(tokens)
        self._waited = time.perf_counter() - w0
        committed = [
            _absorbed(g, Draft.empty(), Verdict(0, [t]))
            for g, t in zip(gens, chosen, strict=False)  # late rows: nothing yet
        ]
        end = self._ended(gens)
        if pipelined and since is not None:
            self.times.add_plain(len(gens), end - since)
        if since is None or (ahead is not None and not ahead.unread):
            self.times.flush()
        else:  # fresh, or queued by the verify round before its verdicts were read
            self.times.add_fresh(len(gens), end - since, queued=ahead is not None)
        if since is not None:
            self._note_slow(len(gens), 1, end - since)
        return committed

    def _forward(self, inputs: mx.array, queued: bool = False) -> mx.array:
        """The last position's logits (B, V) of a forward of `inputs` (B, 1) over the batch."""
        return self._logits(inputs, queued)[:, -1, :]

    def _logits(self, inputs: mx.array, queued: bool = False) -> mx.array:
        """Logits (B, L, V) of a forward of `inputs` (B, L) over the batch, each row on its own
        adapter (or none); `queued`: behind one the device is running (`lora_cuda.queued`)."""
        with (
            selecting([g.target for g in self.gens]),
            lora_cuda.queued() if queued else nullcontext(),
        ):
            return self.target(inputs, cache=self.cache)

    def _choose(self, logits: mx.array, ahead: list[int]) -> mx.array:
        """Each row's token (B,), row i `ahead[i]` positions past its committed tokens."""
        gens = self.gens
        return choose_rows(
            logits,
            [g.opts for g in gens],
            lambda i: gens[i].rng.keys(len(gens[i].tokens) + ahead[i], 1),
        )

    def drop_ahead(self) -> None:
        """Take the queued plain round back: its position comes off the cache of every row
        it was queued for (not rows that joined since)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        late = len(self.gens) - len(ahead.gens)
        if late:
            trim_rows(self.cache, [ahead.width] * len(ahead.gens) + [0] * late, len(self.gens))
        else:
            self._take_back(ahead.width)

    def _take_back(self, width: int) -> None:
        for c in self.cache:
            c.trim(width)

    def _propose(self, ks: list[int]) -> list[Draft]:
        """Each row's draft of up to ks[i] tokens: rows drafting with the draft model in one
        forward per draft step (`DraftBatch`), the others from their own sources."""
        gens = self.gens
        drafters = [g.batch_drafter(k) for g, k in zip(gens, ks, strict=True)]
        out: list[Draft | None] = [None] * len(gens)
        if any(d is not None for d in drafters):
            self._draft_together(drafters, ks, out)
        return [d if d is not None else g.propose(k) for g, k, d in zip(gens, ks, out, strict=True)]

    def _draft_together(
        self, drafters: list[ModelDraftSource | None], ks: list[int], out: list[Draft | None]
    ) -> None:
        """Fill `out` for the rows whose draft model drafts in the draft batch. Members that
        stopped drafting with it (speculation paused or off) take their K/V back; members not
        drafting this round (a lookup hit) catch up and ride along."""
        first = next(d for d in drafters if d is not None)
        if self.drafts is None:
            self.drafts = DraftBatch(base_of(first.model))
        batch = self.drafts
        owner: dict[int, int] = {}
        for i, g in enumerate(self.gens):
            part = g.source.model_part() if g.source is not None and g.spec.on else None
            if part is not None:
                owner[id(part)] = i
        for s in [s for s in batch.sources if id(s) not in owner]:
            batch.leave(s)
        batch.join([d for d in drafters if d is not None and d not in batch and batch.can_join(d)])
        if not len(batch):
            return
        rows = [owner[id(s)] for s in batch.sources]
        members = list(zip(rows, batch.sources, strict=True))
        counts = [ks[i] if drafters[i] is s else 0 for i, s in members]
        if not any(counts):
            return
        try:
            drafts = batch.propose([self.gens[i].tokens for i in rows], counts)
        except Exception as exc:  # a broken draft must not fail the rows: they decode plainly
            self.drafts = None
            for i, s in members:
                s.batch, s.cache = None, []
                self.gens[i].spec.stop(f"draft source failed: {exc}")
            return
        for (i, s), d in zip(members, drafts, strict=True):
            if drafters[i] is s:
                out[i] = d

    def keep(self, kept: list[int], width: int) -> None:
        """After a `width`-token forward, keep `kept[i]` of row i's new positions: what every
        row dropped is trimmed off the end, the rest rolled into each row's left padding."""
        trim_rows(self.cache, [width - k for k in kept], len(self.gens))


def _accepted(drafts: mx.array, chosen: mx.array) -> mx.array:
    """How many of `drafts` the target's `chosen` accept, on the device: up to the first
    that differs, as `decide` counts on the host (the least index that differs; a min, not
    a scan, whose kernels not every backend has)."""
    n = drafts.size
    differs = mx.not_equal(drafts.astype(mx.uint32), chosen[:n].astype(mx.uint32))
    return mx.min(mx.where(differs, mx.arange(n, dtype=mx.int32), n))


def _unread_verdicts(
    drafts: list[Draft],
    chosen: list[mx.array],
    width: int,
    inputs: mx.array,
    picks: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """Each row's count of positions kept after a verify round of `width` (its accepted drafts
    and its next token), (rows,) int32, and that next token, (rows,) uint32, on the device.
    Where every row's choices are its row of `picks` (its drafts are its row of `inputs`
    after the first), for all rows in a few operations (each a kernel the host encodes on a
    GPU) where each row's own took six or seven: at 4 rows, 7 against 26 (8 rows: 50)."""
    if picks is not None and width > 1:
        at = mx.array(np.arange(width - 1, dtype=np.int32))[None]
        counts = mx.array(np.array([d.count for d in drafts], dtype=np.int32))[:, None]
        differs = (inputs[:, 1:] != picks[:, :-1]) | (at >= counts)
        accepted = mx.min(mx.where(differs, at, width - 1), axis=1)
        return accepted + 1, mx.take_along_axis(picks, accepted[:, None], axis=1).reshape(-1)
    kept, nexts = [], []
    for d, c in zip(drafts, chosen, strict=True):
        accepted = _accepted(d.tokens, c) if d.count else mx.array(0, dtype=mx.int32)
        kept.append(accepted + 1)
        nexts.append(mx.take(c, accepted).astype(mx.uint32))
    return mx.stack(kept), mx.stack(nexts)


def _same(a: list[Generation], b: list[Generation]) -> bool:
    return len(a) == len(b) and _leads(a, b)


def _leads(a: list[Generation], b: list[Generation]) -> bool:
    """Whether rows `a` are the first rows of `b` (the rest joined since)."""
    return len(a) <= len(b) and all(x is y for x, y in zip(a, b[: len(a)], strict=True))


def warm_rounds(target: nn.Module, rows: int, widths: Sequence[int]) -> None:
    """Run a batch of `rows` through every round width of `widths`, with rows keeping
    different lengths (the roll), then let them leave: the shapes a GPU compiles once."""
    greedy = parse_options({"temperature": 0})
    gens = [Generation(target, [0, 0, 0], greedy, set(), 4, Rng(0)) for _ in range(rows)]
    for g in gens:
        g.prefill()
    batch = RowBatch(target, Costs(verify={1: 1.0}))
    batch.join(gens)
    for _ in range(2):  # plain rounds: one fresh, one from the round queued ahead
        batch.round()
    batch.drop_ahead()
    for width in widths:
        mx.eval(target(mx.zeros((rows, width), dtype=mx.uint32), cache=batch.cache))
        batch.keep([1] + [0] * (rows - 1), width)
        mx.eval([c.state for c in batch.cache])
    while len(batch):
        batch.leave(batch.gens[-1])


def warm_accepts(widths: Sequence[int]) -> None:
    """Count accepted drafts on the device (`_accepted`) once for every verify width: the
    shapes a round queued unread runs, whatever its rows."""
    for width in widths:
        if width > 1:
            chosen = mx.zeros((width,), dtype=mx.uint32)
            mx.eval(mx.take(chosen, _accepted(chosen[1:], chosen)))
