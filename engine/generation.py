"""One request's decode state: the target cache, the committed tokens, its randomness and its
speculation; and how it steps alone.

Every round runs one target forward over [pending] + drafts (0 drafts is plain decoding). The
pending token is the last committed token, not yet in the target cache. Alone, plain decoding
is pipelined: the next forward is queued before the host reads the current token, so between
steps one token may be in flight (`settle` commits it: its value is already fixed by the
position-keyed sampling). In a batch (`engine.batch`) the same state is stepped with other
rows through `draft` and `absorb`. When a draft source fails or a cache cannot be trimmed, the
generation carries on with plain decoding; the client sees an ordinary stream.

A grammar (`engine.grammar`) masks every choice: plain steps mask the next token (the mask is
computed on the host while the forward runs; a token the mask forces is committed without
sampling or waiting, its forward queued at once); speculative rounds walk the drafts, masking each
drafted position as the grammar stands after the drafts before it, and the matcher keeps only
what was accepted. The grammar ending ends the generation ("stop").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlxd.engine import branches
from mlxd.engine.branches import Grid, branchable, grid_of, keep_branch, laid_out
from mlxd.engine.drafting import Draft, DraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.grammar import GrammarFailed, Matcher, Walk, settle, walk
from mlxd.engine.kvcache import make_cache, plain_kv
from mlxd.engine.logprobs import (
    LogprobArrays,
    TokenLogprob,
    logprob_arrays,
    position_logprobs,
    read_logprobs,
)
from mlxd.engine.options import SamplingOptions
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng, choose, next_tokens, to_int, to_ints
from mlxd.engine.specstate import CATCH_UP_RATIO, Mode, Speculation
from mlxd.engine.speculation import DraftLengthController, SpecStats
from mlxd.engine.verify import Verdict, verify, verify_grid

log = logging.getLogger(__name__)
TRACE = os.environ.get("MLXD_TRACE_SPEC", "") not in ("", "0", "false")
# a round whose drafts can be guessed is queued behind the token in flight (`_round_behind`)
ROUND_BEHIND = os.environ.get("MLXD_ROUND_BEHIND", "1") != "0"


class Generation:
    """Yields committed tokens step by step; stops after EOS or `limit` tokens."""

    def __init__(
        self,
        target: nn.Module,
        prompt: Sequence[int],
        opts: SamplingOptions,
        eos: set[int],
        limit: int,
        rng: Rng,
        source: DraftSource | None = None,
        controller: DraftLengthController | None = None,
        stats: SpecStats | None = None,
        cache: list[Any] | None = None,
        grammar: Matcher | None = None,
    ) -> None:
        """`cache`, when given, already holds K/V for a prefix of `prompt` (a prefix-cache hit);
        prefill computes only the rest. `grammar` constrains every token (structured output)."""
        if not prompt:
            raise ValueError("a generation needs at least one prompt token")
        self.target = target
        self.opts = opts
        self.eos = eos
        self.limit = limit
        self.rng = rng
        self.grammar = grammar
        self.tokens: list[int] = list(prompt)
        self.cache: list[Any] = cache if cache is not None else make_cache(target)
        self.stats = stats or SpecStats()
        self.spec = Speculation(source, controller, self.stats)
        self.produced = 0
        self._source_behind = False  # the source has not yet read the committed tokens
        self._inflight: mx.array | None = None  # the next token, queued; its input is cached
        # with a grammar, the forward is queued but the choice waits for the mask: the logits
        # after the last committed token (whose K/V are then in the cache)
        self._queued: mx.array | None = None
        self.finish: str | None = None  # "stop" after EOS, "length" at the limit
        self.logprobs: list[TokenLogprob] = []  # committed, not yet taken (top_logprobs set)
        self._step_logits: mx.array | None = None  # the last plain step's, when logprobs wanted
        self._round: tuple[int, str] = (0, "")  # the last round's draft count and its arm
        # nothing between plain tokens but the forward and the choice (`_lean_step`); greedy
        # only: sampled, an H200 decoded at a quarter of the speed of `_plain_step`
        self._lean = (
            opts.greedy
            and grammar is None
            and opts.top_logprobs is None
            and not opts.has_penalties
            and opts.kv_bits is None
        )
        if source is not None and not can_trim_prompt_cache(self.cache):
            self.spec.stop("the target cache cannot be trimmed", failed=False)

    @property
    def source(self) -> DraftSource | None:
        return self.spec.source

    @property
    def controller(self) -> DraftLengthController | None:
        return self.spec.controller

    @property
    def done(self) -> bool:
        return self.finish is not None or self.produced >= self.limit

    # -- lifecycle -----------------------------------------------------------------------------

    def prefill(self) -> None:
        head = self.tokens[self.cached_tokens : -1]
        if head:
            feed(self.target, self.cache, head)
            mx.eval([c.state for c in self.cache])
        self._maybe_quantize()
        self._source_behind = self.source is not None

    def ready_source(self) -> None:
        """Let the draft source read the committed tokens, once: when the row first drafts
        (`draft_length`; in a batch, once the batch takes its drafts), not with the prompt. A
        request whose speculation stays paused, or a batch row whose drafts the batch keeps
        declining, never pays for it (the prefix cache catches the draft up after the
        response instead)."""
        if not self._source_behind or self.source is None:
            return
        self._source_behind = False
        t0 = time.perf_counter()
        try:
            self.source.prefill(self.tokens)
        except Exception as exc:  # a broken draft must not fail the request
            self.spec.stop(f"draft prefill failed: {exc}")
            return
        if self.controller is not None:  # what reading the prompt cost is part of the trial
            self.controller.charge(time.perf_counter() - t0)

    def close(self) -> None:
        self.spec.close(self.produced)
        self._inflight = self._queued = None
        self.cache = []

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V are really in the target cache (may lead the stream by one)."""
        return int(self.cache[0].offset) if self.cache else 0

    @property
    def batchable(self) -> bool:
        """Whether the target cache can sit in a batch cache: plain K/V layers that stay
        unquantized (a row asking for KV quantization decodes in its own forward)."""
        if self.opts.kv_bits is not None or not self.cache:
            return False
        return all(plain_kv(c) for c in self.cache)

    def _maybe_quantize(self) -> None:
        opts = self.opts
        if opts.kv_bits is not None:
            maybe_quantize_kv_cache(
                self.cache, opts.quantized_kv_start, opts.kv_group_size, opts.kv_bits
            )

    # -- stepping alone ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        while not self.done:
            new = self.step()
            if new:
                yield new
        if self.finish is None:
            self.finish = "length"

    def step(self) -> list[int]:
        """One solo step: a speculative round, or one plainly decoded token."""
        if self._inflight is not None and self._lean and self._plain_for_two():
            return self._lean_step(self._inflight)
        if self.done:
            return []
        k = self.draft_length()
        guess = self._guess(k) if k and self._inflight is not None else None
        if self.spec.on and guess is None and (k == 0 or self._in_flight):
            # no draft this time (e.g. prompt lookup found no match): decode plainly, queueing
            # the next token only while the source still has nothing to propose
            return self._plain_step(lambda: not self._has_draft())
        if not self.spec.on:
            return self._plain_step(self._plain_ahead)
        t0 = time.perf_counter()
        new = self._speculative_round(k) if guess is None else self._round_behind(guess)
        self._maybe_quantize()
        if self.controller is not None and self.spec.on:
            drafted, arm = self._round
            self.controller.observe_time(time.perf_counter() - t0, len(new), drafted, arm)
        return new

    def draft_length(self, ready: bool = True) -> int:
        """Drafts this row wants next round: 0 when speculation is not on, when the source
        has nothing to propose, or near the limit. `ready`: the source reads what it has not
        yet read now (else the caller readies it where the drafts are taken)."""
        k = min(self.spec.draft_length(self.produced), self.limit - self.produced - 1)
        if k <= 0 or not self.spec.on:
            return 0
        if ready:
            self.ready_source()
        if not self.spec.on or not self._has_draft():
            return 0
        return k

    def _plain_ahead(self) -> bool:
        """Whether the token after the next is decoded plainly too (so it can be queued)."""
        if self.spec.mode is Mode.PAUSED:
            return self.spec.pause_left > 1
        return self.spec.mode is Mode.OFF

    @property
    def plain_only(self) -> bool:
        """Whether each token is chosen with nothing read on the host between forwards (no
        grammar mask, penalty or logprobs): what a pipelined batch round needs."""
        opts = self.opts
        return self.grammar is None and not opts.has_penalties and opts.top_logprobs is None

    def plain_next(self) -> bool:
        """Whether the round after the next is plain as well, as far as the host knows now."""
        if self.spec.on:
            return not self._has_draft()
        return self._plain_ahead()

    def next_want(self) -> int:
        """Drafts this row asks for in the round after the next, as far as the host knows now
        (where `plain_next` says it may draft): a row with speculation on, its `draft_length`;
        a row whose pause ends with the next token, what its controller wants on resuming."""
        if self.spec.on:
            return self.draft_length(ready=False)
        controller = self.controller
        if self.spec.mode is Mode.PAUSED and controller is not None and not controller.hopeless():
            return max(0, min(controller.wanted(), self.limit - self.produced - 2))
        return 0

    def _has_draft(self) -> bool:
        return self.source is not None and self.source.has_draft(self.tokens)

    def _worth_resuming(self) -> bool:
        """Whether the rest of the request repays the source's catch-up after a pause."""
        if self.source is None:
            return False
        return self.source.lag(self.tokens) * CATCH_UP_RATIO <= self.limit - self.produced

    def _commit(self, new: list[int], walked: int = 0) -> list[int]:
        """Append new tokens up to EOS (kept, so callers see why it ended), the limit, and the
        grammar's end. The grammar already holds the first `walked` (a verify walk's)."""
        out: list[int] = []
        for i, tok in enumerate(new):
            if self.produced >= self.limit:
                break
            g = self.grammar
            if g is not None and i >= walked and tok not in self.eos and g.consume([tok]) != 1:
                error = g.error
                raise GrammarFailed(
                    f"the output's grammar failed: {error}"
                    if error
                    else f"the grammar refused token {tok}"
                )
            out.append(tok)
            self.tokens.append(tok)
            self.produced += 1
            # the matcher stands after token i once past the walked tokens it already holds
            if tok in self.eos or (g is not None and i + 1 >= walked and g.stopped):
                self.finish = "stop"
                break
        if self.grammar is not None and len(out) < walked:
            self.grammar.rollback(walked - len(out))  # cut by the limit or the grammar's end
        if self.finish is None and self.produced >= self.limit:
            self.finish = "length"
        return out

    @property
    def _in_flight(self) -> bool:
        return self._inflight is not None or self._queued is not None

    def _forward_one(self, tok: mx.array, position: int) -> mx.array:
        """Feed `tok`; the token chosen after it, which sits at `position`."""
        return self._choose(self._feed(tok), position)

    def _feed(self, tok: mx.array) -> mx.array:
        return self.target(tok.reshape(1, 1), cache=self.cache)[0, -1:, :]

    def _choose(self, logits: mx.array, position: int) -> mx.array:
        if self.opts.top_logprobs is not None:
            self._step_logits = logits  # read once the token is committed (`_record`)
        return next_tokens(logits, self.tokens, [], self.opts, self.rng, position)[0]

    def _plain_step(self, ahead: Any) -> list[int]:
        """Commit one token decoded plainly. Pipelined (the next forward queued before the
        host reads this token) while `ahead()` says the next step is plain as well and no
        penalty needs this token on the host first. A request's first token reads its token
        before it builds and queues the next forward: on an H200, a 7k-token prompt restored
        from the prefix cache had its first token 12-13 ms into a step that read it with
        nothing queued after it, against 16-25 ms with the next forward queued before the
        read (the device ran that forward first). The token after a round is queued and the
        next forward built while the device computes it: built after the read, its host time
        (2.5 ms there) left the device idle after every round, and a row drafting by prompt
        lookup decodes most of its tokens plainly between rounds (on the fat bf16 pair its
        plain steps took 5.80 ms against plain decoding's 4.98; on this CPU, code pair, 11.53
        against 11.10 before and 11.16-11.30 against 11.17 after)."""
        if self.grammar is not None:
            return self._grammar_step(ahead)
        y, queued = self._inflight, self._queued
        self._inflight = self._queued = None
        if y is None:
            if queued is None:
                queued = self._feed(mx.array([self.tokens[-1]], dtype=mx.uint32))
            y = self._choose(queued, len(self.tokens))
            if self.produced:
                mx.async_eval(y)  # read below, once the next forward is queued behind it
            else:
                mx.eval(y)
        found = self._issue_logprobs(y)  # before the next choice takes over `_step_logits`
        # penalties need y on the host first
        if self.produced + 1 < self.limit and ahead() and not self.opts.has_penalties:
            self._inflight = self._forward_one(y, len(self.tokens) + 1)
            mx.async_eval(self._inflight)
        new = self._commit([to_int(y)])
        self._take_logprobs(found, new)
        if self.done:
            self._inflight = self._queued = None  # queued past the end: never committed
        self.spec.committed_plainly(len(new), self._worth_resuming)
        self._maybe_quantize()
        return new

    def _grammar_step(self, ahead: Any) -> list[int]:
        """`_plain_step` under a grammar. The token's choice needs the mask after the last
        committed token, but the forward that gives its logits does not: that forward is
        always queued first (the previous step queued it on the lazy token), and the host
        computes the mask while it runs, then queues the masked choice and, on the lazy
        choice, the next forward, and only then waits for the token. When the mask allows
        a single token, the token is known on the host: nothing is sampled or waited for,
        and the next forward is queued at once (the device then runs ahead of the host)."""
        g = self.grammar
        assert g is not None
        logits, self._queued = self._queued, None
        if logits is None:
            logits = self._feed(mx.array([self.tokens[-1]], dtype=mx.uint32))
            mx.async_eval(logits)
        bits, forced = g.next_mask()  # on the host while the forward runs
        if forced is not None and self.opts.top_logprobs is None:
            new = self._commit([forced])
            if not self.done and ahead():
                self._queued = self._feed(mx.array(new, dtype=mx.uint32))
                mx.async_eval(self._queued)
        else:
            if self.opts.top_logprobs is not None:
                self._step_logits = logits
            y = next_tokens(
                logits,
                self.tokens,
                [],
                self.opts,
                self.rng,
                len(self.tokens),
                g.bias_of(bits, logits.dtype),
            )[0]
            # queued on its own, so the device can run the choice while the host builds the
            # next forward: one evaluation for both ran grammar decoding at 0.85x plain on an
            # H200 start (0.94-0.95x this way, on another)
            mx.async_eval(y)
            found = self._issue_logprobs(y)
            if self.produced + 1 < self.limit and ahead():
                self._queued = self._feed(y)
                mx.async_eval(self._queued)
            new = self._commit([to_int(y)])
            self._take_logprobs(found, new)
        if self.done:
            self._queued = None  # queued past the end: never committed
        self.spec.committed_plainly(len(new))
        self._maybe_quantize()
        return new

    def _plain_for_two(self) -> bool:
        """Whether this token and the next are decoded plainly (speculation off, or paused for
        two more tokens at least): a paused row decodes as fast as one that never drafted."""
        spec = self.spec
        return spec.mode is Mode.OFF or (spec.mode is Mode.PAUSED and spec.pause_left > 1)

    def _lean_step(self, y: mx.array) -> list[int]:
        """`_plain_step` for the common case, with nothing but the forward between tokens:
        no speculation for two tokens, no grammar, penalties, logprobs or KV quantization, the
        next token already queued. Queues the one after it, then reads this one (the same
        choices)."""
        position = len(self.tokens) + 1
        if self.produced + 1 < self.limit:
            logits = self.target(y.reshape(1, 1), cache=self.cache)[0, -1:, :]
            queued = choose(logits, self.opts, self.rng, position)[0]
            mx.async_eval(queued)
            self._inflight = queued
        else:
            self._inflight = None
        tok = int(y.item())  # type: ignore[arg-type]
        self.tokens.append(tok)
        self.produced += 1
        if tok in self.eos:
            self.finish = "stop"
            self._inflight = None  # queued past the end: never committed
        elif self.produced >= self.limit:
            self.finish = "length"
        if self.spec.mode is Mode.PAUSED:
            self.spec.committed_plainly(1, self._worth_resuming)
        return [tok]

    def settle(self) -> list[int]:
        """Commit the token in flight, if any: afterwards the cache holds every committed
        token but the last (what a round, a batch or the prefix cache expects)."""
        if not self._in_flight:
            return []
        return self._plain_step(lambda: False)

    def _speculative_round(self, k: int) -> list[int]:
        draft = self.propose(k)
        grid = self._grid(draft)
        if grid is not None:
            return self._grid_round(draft, grid)
        self._round = (draft.count, draft.source)
        pending = mx.array([self.tokens[-1]], dtype=mx.uint32)
        inputs = mx.concatenate([pending, draft.tokens]) if draft.count else pending
        logits = self.target(inputs[None], cache=self.cache)[0]
        walked = self.walk(draft, logits)
        bias = walked.bias if walked is not None else None
        verdict = verify(logits, draft, self.tokens, self.opts, self.rng, bias)
        self._drop_rejected(draft, verdict)
        return self.absorb(draft, verdict, walked, logits)

    def _drop_rejected(self, draft: Draft, verdict: Verdict) -> None:
        """Trim the rejected drafts' K/V off the target cache (rebuilt where it cannot be)."""
        rejected = draft.count - verdict.accepted
        if rejected and trim_prompt_cache(self.cache, rejected) != rejected:
            self._rebuild_cache(len(self.tokens) - 1 + verdict.accepted)
            self.spec.stop("the target cache could not be trimmed")

    def _guess(self, k: int) -> Draft | None:
        """Drafts for a round queued behind the token in flight, guessed before it is read:
        prompt lookup's continuation past the token it expects there (`DraftSource.follow`).
        None where the source cannot guess without running a model, or the row reads anything
        on the host between forwards."""
        source = self.source
        k = min(k, self.limit - self.produced - 2)  # the token in flight commits first
        if not ROUND_BEHIND or k <= 0 or source is None or not self.plain_only:
            return None
        try:
            drafts = source.follow(self.tokens, k + 1)[1:]
        except Exception as exc:
            self.spec.stop(f"draft source failed: {exc}")
            return None
        if not drafts:
            return None
        return Draft(mx.array(drafts, dtype=mx.uint32), len(drafts), LookupDraftSource.name)

    def _round_behind(self, draft: Draft) -> list[int]:
        """Commit the token in flight and a round verifying `draft` after it, the round's
        forward queued before that token is read. A round built after the read leaves the
        device idle while the host builds it, once for every span the source starts to copy.
        Lossless whatever the token turns out to be: the forward's first input is the token
        itself, and drafts guessed after another token are only drafts that fail."""
        y, self._inflight = self._inflight, None
        assert y is not None
        self._round = (draft.count, draft.source)
        pending = y.reshape(1) if y.dtype == mx.uint32 else y.reshape(1).astype(mx.uint32)
        inputs = mx.concatenate([pending, draft.tokens])
        logits = self.target(inputs[None], cache=self.cache)[0]
        mx.async_eval(logits)
        self.stats.behind += 1
        first = self._commit([to_int(y)])
        if self.done:  # the drafts' K/V go; the token's stay, as a queued plain step's do
            trim_prompt_cache(self.cache, draft.count)
            return first
        verdict = verify(logits, draft, self.tokens, self.opts, self.rng)
        self._drop_rejected(draft, verdict)
        return first + self.absorb(draft, verdict, None, logits)

    def _grid(self, draft: Draft) -> Grid | None:
        """The branches this round verifies where the source knows other continuations than
        its draft and the measured verify costs take them for about the price of the draft
        alone (None: the draft alone). Plain choices only: no grammar, penalty or logprobs."""
        controller, source = self.controller, self.source
        if not draft.count or controller is None or source is None or not self.plain_only:
            return None
        most = controller.costs.branches(draft.count + 1, branches.MAX_BRANCHES)
        if most < 2 or not branchable(self.target, self.cache):
            return None
        found = source.alternatives(self.tokens, draft.count, most)
        if len(found) < 2:
            return None
        grid = grid_of(self.tokens[-1], found[0], found[1:])
        return grid if grid.count > 1 else None

    def _grid_round(self, draft: Draft, grid: Grid) -> list[int]:
        """Verify every branch of `grid` in one forward; the cache keeps the winner's keys."""
        start = self.cached_tokens
        with laid_out(self.target, self.cache, grid):
            logits = self.target(mx.array([grid.tokens], dtype=mx.uint32), cache=self.cache)[0]
        branch, verdict = verify_grid(logits, grid, self.tokens, self.opts, self.rng)
        keep_branch(self.cache, start, branch, grid.width, verdict.accepted + 1)
        self._round = (grid.count * grid.width - 1, draft.source)  # priced as its whole width
        won = Draft(mx.array(grid.drafts[branch], dtype=mx.uint32), grid.length, draft.source)
        return self.absorb(won, verdict)

    def _record(self, logits: mx.array | None, new: list[int]) -> None:
        """Keep the committed tokens' log-probabilities when the request asked for them."""
        k = self.opts.top_logprobs
        if k is not None and logits is not None:
            self.logprobs += position_logprobs(logits, new, k)

    def _issue_logprobs(self, y: mx.array) -> LogprobArrays | None:
        """The log-probabilities of this step's token `y` (chosen from `_step_logits`) where
        the request wants them, issued to the device now: built once the next forward is
        queued, they would be evaluated behind it, and reading them would wait for it."""
        k, logits = self.opts.top_logprobs, self._step_logits
        if k is None or logits is None:
            return None
        found = logprob_arrays(logits, y.reshape(-1), k)
        mx.async_eval(found.arrays)
        return found

    def _take_logprobs(self, found: LogprobArrays | None, new: list[int]) -> None:
        if found is not None:
            self.logprobs += read_logprobs(found, new)

    def take_logprobs(self) -> list[TokenLogprob]:
        taken, self.logprobs = self.logprobs, []
        return taken

    # -- what a batch calls --------------------------------------------------------------------

    def propose(self, k: int) -> Draft:
        """The source's draft of up to k tokens (empty when it fails: speculation stops)."""
        if k <= 0 or self.source is None:
            return Draft.empty()
        try:
            return self.source.propose(self.tokens, k)
        except Exception as exc:
            self.spec.stop(f"draft source failed: {exc}")
            return Draft.empty()

    def batch_drafter(self, k: int) -> ModelDraftSource | None:
        """The draft model a batch may run for this row's next k drafts (None: `propose`)."""
        if k <= 0 or self.source is None:
            return None
        try:
            return self.source.batch_part(self.tokens, k)
        except Exception as exc:
            self.spec.stop(f"draft source failed: {exc}")
            return None

    @property
    def drafts_batched(self) -> bool:
        """Whether this row's drafts come from a draft model a batch runs for all its rows."""
        source = self.source
        if source is None or not self.spec.on or self.opts.has_penalties:
            return False
        return source.model_part() is not None

    def walk(self, draft: Draft, logits: mx.array) -> Walk | None:
        """The grammar's masks over this round's drafted positions (None without a grammar).
        The verify forward is queued first: the host walks the grammar while it runs."""
        if self.grammar is None:
            return None
        mx.async_eval(logits, draft.tokens)
        return walk(self.grammar, to_ints(draft.tokens) if draft.count else [])

    def absorb(
        self,
        draft: Draft,
        verdict: Verdict,
        walked: Walk | None = None,
        logits: mx.array | None = None,
    ) -> list[int]:
        """Commit a verified round (the caller trimmed the target cache to match); with a
        grammar, its matcher keeps only the accepted drafts of the walk. `logits`: the verify
        forward's for this row, read when the request wants logprobs."""
        scored = draft.scored  # a batch's fillers teach no record (`Draft.filler`)
        if scored and self.controller is not None:
            self.stats.observe(scored, min(verdict.accepted, scored))
            self.controller.observe(scored, min(verdict.accepted, scored))
        if draft.filler:
            self.stats.filled += draft.filler
            self.stats.filled_accepted += max(0, verdict.accepted - scored)
        if TRACE:
            log.info(
                "spec round: source=%s drafted=%d filler=%d accepted=%d",
                draft.source, scored, draft.filler, verdict.accepted,
            )  # fmt: skip
        held = 0
        if self.grammar is not None and walked is not None:
            held = settle(self.grammar, walked, verdict.accepted)
        new = self._commit(verdict.tokens, held)
        self._record(logits, new)
        if not scored:
            self.spec.committed_plainly(len(new), self._worth_resuming)
        if self.source is not None and self.finish is None and draft.count:
            try:
                self.source.accept(self.tokens)
            except Exception as exc:
                self.spec.stop(f"draft source failed: {exc}")
        return new

    def _rebuild_cache(self, keep: int) -> None:
        """Recompute the target cache for the first `keep` committed tokens."""
        self.cache = make_cache(self.target)
        if keep:
            feed(self.target, self.cache, self.tokens[:keep])
            mx.eval([c.state for c in self.cache])
