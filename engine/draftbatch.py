"""A draft model drafting for every batched row at once: one forward per draft step.

Drafting row by row costs B x k single-token forwards of the draft model per round; here the
rows' draft K/V live in one batch cache (mlx-lm's `BatchKVCache`, laid out as the model's own
caches are) and each draft step is one B x 1 forward. The first forward of a round catches
every row up on the committed tokens its draft has not read (1 or 2 after a round that drafted,
more after rounds that did not): every row re-reads the last M committed tokens, M the most any
row misses, so the input needs no padding and every row's next logits sit at the last column.
A row re-reads what it already held by dropping those positions first; that drop and the
rejected drafts of the round before are one per-row trim (`trim_rows`), so a round rolls the
cache at most once. Only a row shorter than M is right-padded and trimmed after the forward.

Each row samples its drafts with its own options, `Rng` and position-keyed noise, exactly as
`ModelDraftSource.propose` does alone, so the proposal is the same whichever way the row is
stepped. A row's source stays the owner of its state: `cached` says which committed tokens
the draft has read, and the batch only remembers how many positions it physically holds for
the row (what rejected drafts left behind is trimmed lazily, at the next round or on leave).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxd.engine import compiledstep, kvcache
from mlxd.engine.adapters import AdaptedModel, selecting
from mlxd.engine.drafting import Draft, ModelDraftSource, confidence
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng, choose_rows, to_floats, to_ints

COMPACT = 64  # positions of left padding shared by every row before the cache cuts them


def base_of(model: Any) -> Any:
    """The module a forward really runs (an adapter view selects rows on its base)."""
    return model.model if isinstance(model, AdaptedModel) else model


def trim_rows(cache: list[Any], amounts: Sequence[int], rows: int) -> None:
    """Drop the last `amounts[i]` positions of row i in every layer: what all rows drop is
    trimmed off the end, the rest rolled into each row's left padding (masked). Cuts the
    shared left padding once it is worth a copy (a bucketed cache: whole buckets of it)."""
    if not amounts or not any(amounts):
        return
    common = min(amounts)
    rest = [a - common for a in amounts]
    for c in cache:
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()
    if any(rest):
        cut_padding(cache, rows)


def cut_padding(cache: list[Any], rows: int, least: int | None = None) -> None:
    """Cut the left padding every row shares once it is worth a copy (a bucketed cache: whole
    buckets of it): rows that dropped different amounts keep them as left padding. `least`:
    that shared padding, known to the caller (else read from the device)."""
    first = cache[0]
    bucketed = isinstance(first, kvcache.BucketedBatchKVCache)
    if bucketed and not first.may_cut():
        return
    if least is None:
        least = min(to_ints(first.left_padding))
    if least >= (first.step if bucketed else COMPACT):
        for c in cache:
            if bucketed:
                c.filter(mx.arange(rows), least)
            else:
                c.filter(mx.arange(rows))


def catch_up_width(missing: int, shaped: bool) -> int:
    """The width of a catch-up forward for rows missing up to `missing` tokens. Where shapes
    compile (bucketed caches) a power of two: rows re-read more of what they hold rather
    than run a width never seen (on an H200, each new width cost a compile of ~50 ms in
    front of a verify round, ten times the round)."""
    return 1 << (missing - 1).bit_length() if shaped else missing


class DraftBatch:
    """Rows' draft K/V in one batch cache of the draft model; rows join and leave between
    rounds, and a leaving row's source gets its own cache back."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # the base draft model (rows may see it through adapters)
        self.sources: list[ModelDraftSource] = []
        self.held: list[int] = []  # positions the cache holds per row (>= len(source.cached))
        self.cache: list[Any] = []
        self.forwards = 0  # draft forwards run (one per draft step of a round)
        self.compiled = compiledstep.enabled()

    def __len__(self) -> int:
        return len(self.sources)

    def __contains__(self, source: object) -> bool:
        return any(s is source for s in self.sources)

    def can_join(self, source: ModelDraftSource) -> bool:
        """A source whose own cache is plain K/V in step with what it has read, on this model."""
        if source.batch is not None or base_of(source.model) is not self.model:
            return False
        own = source.cache
        return (
            bool(own)
            and all(kvcache.plain_kv(c) for c in own)
            and (int(own[0].offset) == len(source.cached))
        )

    def join(self, sources: Sequence[ModelDraftSource]) -> None:
        if not sources:
            return
        kind = kvcache.batch_type(self.model)
        layers = len(sources[0].cache)
        merged = [kind.merge([s.cache[i] for s in sources]) for i in range(layers)]
        if self.cache:
            for mine, new in zip(self.cache, merged, strict=True):
                mine.extend(new)
        else:
            self.cache = merged
        for s in sources:
            self.held.append(len(s.cached))
            s.cache = []  # the batch holds the row's draft K/V until it leaves
            s.batch = self
            self.sources.append(s)

    def leave(self, source: ModelDraftSource, keep: bool = True) -> None:
        """Drop a row; with `keep`, its source gets the positions it has read as its own cache."""
        slot = next(i for i, s in enumerate(self.sources) if s is source)
        if keep:
            source.cache = self._extract(slot, len(source.cached))
        source.batch = None
        del self.sources[slot], self.held[slot]
        if not self.sources:
            self.cache = []
            return
        rest = [i for i in range(len(self.sources) + 1) if i != slot]
        for c in self.cache:
            c.filter(mx.array(rest))

    def _extract(self, slot: int, length: int) -> list[Any]:
        step = kvcache.bucket_of(self.model)
        own = []
        for c in self.cache:
            layer = kvcache.new_kv_cache(step)
            if c.keys is not None and length:
                left = to_ints(c.left_padding)[slot]
                keys = mx.contiguous(c.keys[slot : slot + 1, :, left : left + length])
                values = mx.contiguous(c.values[slot : slot + 1, :, left : left + length])
                layer.update_and_fetch(keys, values)
            own.append(layer)
        return own

    def propose(self, tokens: Sequence[Sequence[int]], counts: Sequence[int]) -> list[Draft]:
        """Up to `counts[i]` drafts for row i after its committed `tokens[i]`, in one forward
        per draft step for all rows (a row asking for 0 catches up and rides along). With the
        rows' measured costs, the chain stops where one more step cannot pay for the rows
        still drafting (`DraftGate`)."""
        rows = len(self.sources)
        steps = max(counts)
        gate = next((s.gate for s in self.sources if s.gate is not None), None)
        opts = [s.opts for s in self.sources]
        reach = [1.0] * rows
        logits = self._catch_up(tokens)
        columns: list[mx.array] = []
        for j in range(steps):
            tok = self._sample(logits, tokens, j)
            columns.append(tok)
            last = j == steps - 1
            sure = confidence(logits, tok, opts) if gate is not None and not last else None
            # the device runs this step while the host builds the next
            mx.async_eval(tok, *([sure] if sure is not None else []))
            if last:
                break
            if gate is not None and sure is not None:  # read once this step is done
                reach = [r * p for r, p in zip(reach, to_floats(sure), strict=True)]
                going = [i for i, n in enumerate(counts) if n > j + 1]
                if not gate.goes_on([reach[i] for i in going], j + 1):
                    for i in going:
                        self.sources[i].cut += 1
                    break
            with selecting([s.model for s in self.sources]):
                logits = self._forward(tok[:, None])[:, -1, :]
            self.forwards += 1
            self.held = [h + 1 for h in self.held]
        drafted = mx.stack(columns, axis=1)  # (rows, steps run)
        out = []
        for i in range(rows):
            s, n = self.sources[i], min(counts[i], len(columns))
            s.cached = list(tokens[i])
            if n <= 0:
                s._drafts, s._fed = None, 0
                out.append(Draft.empty(s.name))
                continue
            # every fed draft is in this row's cache: a bonus token equal to one keeps its K/V
            s._drafts, s._fed = drafted[i], len(columns) - 1
            out.append(Draft(drafted[i, :n], n, s.name))
        return out

    def _catch_up(self, tokens: Sequence[Sequence[int]]) -> mx.array:
        """One forward reading the committed tokens each row's draft misses; each row's logits
        after its last committed token (rows, vocab)."""
        missing = [
            max(len(t) - len(s.cached), 1) for t, s in zip(tokens, self.sources, strict=True)
        ]
        width = catch_up_width(max(missing), kvcache.bucket_of(self.model) is not None)
        feed = [min(width, len(t)) for t in tokens]
        # keep only what precedes the re-read tokens (rejected drafts go with it)
        trim_rows(
            self.cache,
            [h - (len(t) - f) for h, t, f in zip(self.held, tokens, feed, strict=True)],
            len(tokens),
        )
        rows = [
            list(t[len(t) - f :]) + [t[-1]] * (width - f) for t, f in zip(tokens, feed, strict=True)
        ]
        with selecting([s.model for s in self.sources]):
            out = self._forward(mx.array(rows, dtype=mx.uint32))
        self.forwards += 1
        if all(f == width for f in feed):
            logits = out[:, -1, :]
        else:
            last = mx.array([f - 1 for f in feed])
            logits = out[mx.arange(len(rows)), last]
            trim_rows(self.cache, [width - f for f in feed], len(rows))
        self.held = [len(t) for t in tokens]
        return logits

    def _forward(self, tokens: mx.array) -> mx.array:
        return compiledstep.forward(self.model, self.cache, tokens, self.compiled)

    def _sample(self, logits: mx.array, tokens: Sequence[Sequence[int]], step: int) -> mx.array:
        """Each row's draft at its position, as it would be chosen alone (no penalties here)."""
        sources = self.sources
        return choose_rows(
            logits,
            [s.opts for s in sources],
            lambda i: sources[i].rng.keys(len(tokens[i]) + step, 1),
        )


WARM_CATCH_UP = 64  # catch-up widths warmed at load: a row benched longer than this is rare


def warm_drafts(model: nn.Module, rows: int, widths: int) -> None:
    """Run a draft batch of `rows` through every catch-up width up to `widths` (each a power of
    two, as `catch_up_width` makes them; those up to `WARM_CATCH_UP` as well) and a draft
    step, with rows trimmed by different amounts (the roll): the shapes a GPU compiles once."""
    greedy = parse_options({"temperature": 0})
    sources = [ModelDraftSource(model, greedy, Rng(0)) for _ in range(rows)]
    for s in sources:
        s.prefill([0, 0, 0, 0])
    if not all(DraftBatch(model).can_join(s) for s in sources):
        return
    batch = DraftBatch(model)
    batch.join(sources)
    shaped = kvcache.bucket_of(model) is not None
    limit = max(widths, WARM_CATCH_UP) if shaped else widths
    catch_ups = {catch_up_width(w, shaped) for w in range(1, limit + 1)}
    for width in sorted(catch_ups):
        mx.eval(model(mx.zeros((rows, width), dtype=mx.uint32), cache=batch.cache))
        trim_rows(batch.cache, [width] + [width - 1] * (rows - 1), rows)
        mx.eval(model(mx.zeros((rows, 1), dtype=mx.uint32), cache=batch.cache))
        trim_rows(batch.cache, [1] * rows, rows)
        mx.eval([c.state for c in batch.cache])
    for s in sources:
        batch.leave(s)
