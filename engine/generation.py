"""One request's decode state: the target cache, the committed tokens and the draft source.

Every round runs one target forward over [pending] + drafts (0 drafts is plain decoding). The
pending token is the last committed token, not yet in the target cache. When a draft source
fails or a cache cannot be trimmed, the generation carries on with plain decoding from the
committed tokens; the client sees an ordinary stream.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlxd.engine.drafting import Draft, DraftSource
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng, next_tokens, to_int
from mlxd.engine.speculation import DraftLengthController, SpecStats
from mlxd.engine.verify import verify

log = logging.getLogger(__name__)
TRACE = os.environ.get("MLXD_TRACE_SPEC", "") not in ("", "0", "false")


class Generation:
    """Yields committed tokens round by round; stops after EOS or `limit` tokens."""

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
    ) -> None:
        """`cache`, when given, already holds K/V for a prefix of `prompt` (a prefix-cache hit);
        prefill computes only the rest."""
        if not prompt:
            raise ValueError("a generation needs at least one prompt token")
        self.target = target
        self.opts = opts
        self.eos = eos
        self.limit = limit
        self.rng = rng
        self.tokens: list[int] = list(prompt)
        self.cache: list[Any] = cache if cache is not None else make_cache(target)
        self.source = source
        self.controller = controller
        self.stats = stats or SpecStats()
        self.produced = 0
        self._source_behind = False  # the source has not yet read the committed tokens
        self.finish: str | None = None  # "stop" after EOS, "length" at the limit
        # after stepping down to a cheaper arm: the full source's controller and the token count
        # then; what the arm decodes counts toward that source's pause clock
        self._stepped_from: tuple[DraftLengthController, int] | None = None
        if source is not None:
            self.stats.method = source.name
            if not can_trim_prompt_cache(self.cache):
                self._fallback("the target cache cannot be trimmed", failed=False)

    # -- lifecycle -----------------------------------------------------------------------------

    def prefill(self) -> None:
        head = self.tokens[self.cached_tokens : -1]
        if head:
            feed(self.target, self.cache, head)
            mx.eval([c.state for c in self.cache])
        self._maybe_quantize()
        self._source_behind = self.source is not None
        if self.controller is None or not self.controller.off:
            self.ready_source()

    def ready_source(self) -> None:
        """Let the draft source read the committed tokens, once. Deferred while the pairing's
        clock pauses speculation from the start: a request that ends inside the pause never
        pays for it (the prefix cache catches the draft up after the response instead)."""
        if not self._source_behind or self.source is None:
            return
        self._source_behind = False
        try:
            self.source.prefill(self.tokens)
        except Exception as exc:  # a broken draft must not fail the request
            self._fallback(f"draft prefill failed: {exc}")

    def close(self) -> None:
        if self._stepped_from is not None:
            full, start = self._stepped_from
            full.paused_for(self.produced - start)
            self._stepped_from = None
        if self.controller is not None:
            self.controller.conclude()
        if self.source is not None:
            self.source.dispose()
            self.source = None
        self.cache = []

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V are really in the target cache (may lead the stream by one)."""
        return int(self.cache[0].offset) if self.cache else 0

    def _maybe_quantize(self) -> None:
        opts = self.opts
        if opts.kv_bits is not None:
            maybe_quantize_kv_cache(
                self.cache, opts.quantized_kv_start, opts.kv_group_size, opts.kv_bits
            )

    # -- decoding ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        while self.finish is None and self.produced < self.limit:
            if self.source is None or self.controller is None:
                yield from self._plain()
                return
            k = min(self.controller.choose(), self.limit - self.produced - 1)
            if self.controller.off:
                pause = self._step_down()
                if pause:  # plain decoding for a while, then speculation gets another chance
                    yield from self._paused(pause)
                continue
            self.ready_source()
            if self.source is None:  # its prefill failed: plain decoding from here
                continue
            if k > 0 and not self._has_draft():  # e.g. prompt lookup found no match
                yield from self._plain(resume=self._has_draft)
                continue
            t0 = time.perf_counter()
            new = self._speculative_round(k)
            self._maybe_quantize()
            if self.controller is not None:
                self.controller.observe_time(time.perf_counter() - t0, len(new))
            if new:
                yield new
        if self.finish is None:
            self.finish = "length"

    def _has_draft(self) -> bool:
        return self.source is not None and self.source.has_draft(self.tokens)

    def _commit(self, new: list[int]) -> list[int]:
        """Append new tokens up to EOS (kept, so callers see why it ended) and the limit."""
        out: list[int] = []
        for tok in new:
            if self.produced >= self.limit:
                break
            out.append(tok)
            self.tokens.append(tok)
            self.produced += 1
            if tok in self.eos:
                self.finish = "stop"
                break
        if self.finish is None and self.produced >= self.limit:
            self.finish = "length"
        return out

    def _speculative_round(self, k: int) -> list[int]:
        assert self.source is not None and self.controller is not None
        try:
            draft = self.source.propose(self.tokens, k) if k > 0 else Draft.empty()
        except Exception as exc:
            self._fallback(f"draft source failed: {exc}")
            return []
        pending = mx.array([self.tokens[-1]], dtype=mx.uint32)
        inputs = mx.concatenate([pending, draft.tokens]) if draft.count else pending
        logits = self.target(inputs[None], cache=self.cache)[0]
        verdict = verify(logits, draft, self.tokens, self.opts, self.rng)
        rejected = draft.count - verdict.accepted
        if rejected and trim_prompt_cache(self.cache, rejected) != rejected:
            self._rebuild_cache(len(self.tokens) - 1 + verdict.accepted)
            self._fallback("the target cache could not be trimmed")
        if draft.count:
            self.stats.observe(draft.count, verdict.accepted)
            self.controller.observe(draft.count, verdict.accepted)
        if TRACE:
            log.info(
                "spec round: source=%s k=%d drafted=%d accepted=%d",
                draft.source, k, draft.count, verdict.accepted,
            )  # fmt: skip
        new = self._commit(verdict.tokens)
        if self.source is not None and self.finish is None:
            try:
                self.source.accept(self.tokens)
            except Exception as exc:
                self._fallback(f"draft source failed: {exc}")
        return new

    def _plain(
        self, until: int | None = None, resume: Callable[[], bool] | None = None
    ) -> Iterator[list[int]]:
        """Single-token decoding up to `until` produced tokens, or until `resume()` turns true
        after a committed token (then the token in flight is the last); pipelined (next forward
        queued before the host reads the current token) unless penalties need every token on
        the host first. It never queues past its end, so the cache ends holding all but the
        last committed token, as a speculative round expects."""
        bound = self.limit if until is None else min(until, self.limit)

        def step(tok: mx.array, extra: list[int]) -> mx.array:
            logits = self.target(tok.reshape(1, 1), cache=self.cache)[0, -1:, :]
            return next_tokens(logits, self.tokens, extra, self.opts, self.rng)[0]

        y = step(mx.array([self.tokens[-1]], dtype=mx.uint32), [])
        mx.async_eval(y)
        pipelined = not self.opts.has_penalties
        while self.finish is None and self.produced < bound:
            nxt = None
            if pipelined and self.produced + 1 < bound:
                nxt = step(y, [])
                mx.async_eval(nxt)
            new = self._commit([to_int(y)])
            self._maybe_quantize()
            yield new
            if self.finish is not None or self.produced >= bound:
                break
            if resume is not None and resume():
                if nxt is None:
                    break
                bound = self.produced + 1  # commit the token in flight; queue nothing more
            y = nxt if nxt is not None else step(mx.array(new, dtype=mx.uint32), [])

    def _paused(self, pause: int) -> Iterator[list[int]]:
        start = self.produced
        try:
            yield from self._plain(until=start + pause)
        finally:  # also when the request ends inside the pause
            if self.controller is not None:
                self.controller.paused_for(self.produced - start)
        if self.controller is not None:
            self.controller.resume()

    def _step_down(self) -> int:
        """Speculation stopped paying: continue with the source's cheaper arm, or pause it for
        the returned number of tokens (backing off each time), or end it for this request."""
        assert self.source is not None and self.controller is not None
        cheaper = self.source.cheaper()
        if cheaper is not None:
            self.stats.disabled_reason = f"{self.source.name}: continued with {cheaper.name} only"
            self._stepped_from = (self.controller, self.produced)
            self.source = cheaper
            self.controller = self.controller.restart(draft_cost=0.0, source=cheaper.name)
            return 0
        pause = self.controller.pause_tokens
        if pause <= 0:
            self.stats.disabled_reason = "speculation no longer pays"
            self._drop_source()
            return 0
        self.stats.paused += 1
        self.stats.disabled_reason = f"speculation paused {self.stats.paused} time(s): not paying"
        return pause

    # -- failure handling ----------------------------------------------------------------------

    def _fallback(self, reason: str, failed: bool = True) -> None:
        if failed:
            log.warning("speculation stopped, continuing with plain decoding: %s", reason)
            self.stats.fallback_reason = reason
        else:
            self.stats.disabled_reason = reason
        self._drop_source()

    def _drop_source(self) -> None:
        if self.source is not None:
            try:
                self.source.dispose()
            finally:
                self.source = None

    def _rebuild_cache(self, keep: int) -> None:
        """Recompute the target cache for the first `keep` committed tokens."""
        self.cache = make_cache(self.target)
        if keep:
            feed(self.target, self.cache, self.tokens[:keep])
            mx.eval([c.state for c in self.cache])
