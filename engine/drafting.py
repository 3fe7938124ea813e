"""Draft sources: per-request producers of draft tokens behind one small protocol.

The verifier never trusts a source; a source only has to keep its own state in step with the
committed tokens it is shown. The length of a returned `Draft` is authoritative (0 is fine).
New kinds (MTP or EAGLE-style heads) implement the same five methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import trim_prompt_cache

from mlxd.engine import compiledstep
from mlxd.engine.kvcache import make_cache
from mlxd.engine.options import SamplingOptions
from mlxd.engine.prefill import feed
from mlxd.engine.sampling import Rng, next_tokens, to_floats, to_int, to_ints
from mlxd.engine.speculation import Costs


@dataclass
class Draft:
    """Proposed tokens (possibly still lazy) and, for sampled drafts, their distributions q.

    The last `filler` of the `count` tokens fill slots of a batch round that its width pays for
    anyway (`DraftSource.filler`): verified like any draft, but no acceptance estimate learns
    from them, since no plan asked for them (a round's time is still judged by every token it
    committed, fillers included)."""

    tokens: mx.array
    count: int
    source: str = ""
    filler: int = 0

    @property
    def scored(self) -> int:
        """The drafts a plan asked for, which speculation's records learn from."""
        return self.count - self.filler

    @staticmethod
    def empty(source: str = "") -> Draft:
        return Draft(mx.array([], dtype=mx.uint32), 0, source)


class DraftSource(ABC):
    """prefill -> (propose -> accept)* -> dispose; checkpoint/restore for the prefix cache."""

    name: str = "draft"

    @abstractmethod
    def prefill(self, tokens: Sequence[int]) -> None:
        """See the committed tokens before the first round (the last one is not yet decoded)."""

    @abstractmethod
    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        """Propose up to n tokens to follow `tokens` (the full committed sequence)."""

    @abstractmethod
    def accept(self, tokens: Sequence[int]) -> None:
        """Learn the committed sequence after verification and drop rejected state."""

    def has_draft(self, tokens: Sequence[int]) -> bool:
        """Whether `propose` would return anything after `tokens`; host work only, asked once per
        token while decoding plainly. Between drafts the target then decodes pipelined instead
        of paying for a round that drafts nothing."""
        return True

    def follow(self, tokens: Sequence[int], n: int) -> list[int]:
        """Up to n tokens this source would propose after `tokens`, which may run past what
        was committed (a guess of what a round in flight commits), learning nothing from them:
        a batch queues its next verify round on these before it reads the round in flight.
        Empty where the source cannot say without running a model."""
        return []

    def filler(self, tokens: Sequence[int], n: int) -> list[int]:
        """Up to n tokens to fill a batch round's slots after `tokens` (which may run past what
        was committed), learning nothing: the row verifies them for free where another row's
        drafts set the round's width, so weaker guesses than a draft's are worth taking.
        Empty where the source cannot say without running a model."""
        return []

    def alternatives(self, tokens: Sequence[int], n: int, most: int) -> list[list[int]]:
        """Up to `most` candidate continuations of n tokens, the first what `propose` gave,
        for a round that verifies several at once (`engine.branches`); empty where the source
        knows only one."""
        return []

    def cheaper(self) -> DraftSource | None:
        """What to continue with when this source no longer pays (None: plain decoding)."""
        return None

    def model_part(self) -> ModelDraftSource | None:
        """The draft model this source runs, if any (a batch drafts its rows together)."""
        return None

    def batch_part(self, tokens: Sequence[int], n: int) -> ModelDraftSource | None:
        """The draft model that would propose the next n tokens, when a batch may run it for
        this row together with others; None: this row proposes on its own (`propose`)."""
        return None

    def runs_model(self, tokens: Sequence[int], n: int) -> bool:
        """Whether proposing n tokens after `tokens` runs a draft model (costs draft steps);
        host work only: a batch prices its round's drafts by it."""
        return self.model_part() is not None

    def lag(self, tokens: Sequence[int]) -> int:
        """Committed tokens the source would have to read before its next draft (a draft
        model's catch-up after a pause); 0 for sources that keep no model state."""
        return 0

    def checkpoint(self) -> Any:
        """Companion state to store with the target's cache; None when there is nothing."""
        return None

    def restore(self, state: Any) -> None:  # noqa: B027 - optional hook
        """Restore what `checkpoint` returned."""

    def dispose(self) -> None:  # noqa: B027 - optional hook
        """Release arrays and caches."""


@dataclass(frozen=True)
class DraftGate:
    """Where a draft model's chain stops short of the k its controller asked for: the next
    draft is worth a token only if it and every draft before it are accepted, so once the
    chance that the drafts so far all are (`reach`, the product of the draft's own
    probabilities of its tokens) times what a token is worth is less than what one more draft
    costs (a draft step and one token more to verify, for every row), the chain ends there.
    The draft's probability predicts acceptance well: greedy drafts of the code pair were
    accepted 37% of the time below 0.2, 77% at 0.4-0.5 and 100% above 0.9."""

    costs: Costs

    def goes_on(self, reaches: Sequence[float], drafted: int) -> bool:
        """Whether the rows drafting together (one reach each; a lone row: one) draft once
        more after `drafted` drafts: a token is worth its share of a plain round of as many
        rows, one more draft step costs what a step of these rows does."""
        costs, rows = self.costs, len(reaches)
        worth = costs.plain * costs.v(rows) / costs.v(1) / rows
        wider = costs.v(rows * (drafted + 2)) - costs.v(rows * (drafted + 1))
        return sum(reaches) * worth >= costs.draft_rows(rows) + wider


def confidence(logits: mx.array, tok: mx.array, opts: Sequence[SamplingOptions]) -> mx.array:
    """Each row's draft probability of its token `tok[i]` after `logits[i]` (rows, V), at the
    row's temperature (greedy: the plain softmax): lazy, (rows, 1)."""
    scaled = logits.astype(mx.float32)
    if not all(o.greedy for o in opts):
        temps = [1.0 if o.greedy else o.temperature for o in opts]
        scaled = scaled / mx.array(temps, dtype=mx.float32)[:, None]
    probs = mx.softmax(scaled, axis=-1)
    return mx.take_along_axis(probs, tok.reshape(-1, 1).astype(mx.int32), axis=-1)


class ModelDraftSource(DraftSource):
    """A standalone draft model with its own KV cache, kept in step with committed tokens.
    With measured `costs`, a chain stops early where its next draft cannot pay (`DraftGate`)."""

    name = "model"

    def __init__(
        self, model: nn.Module, opts: SamplingOptions, rng: Rng, costs: Costs | None = None
    ) -> None:
        self.model = model
        self.opts = opts
        self.rng = rng
        self.gate = DraftGate(costs) if costs is not None and costs.draft_step > 0 else None
        self.cut = 0  # chains the gate ended short of what was asked
        self.compiled = compiledstep.enabled()
        self.cache: list[Any] = make_cache(model)
        self.cached: list[int] = []  # tokens whose K/V are in self.cache
        self._drafts: mx.array | None = None
        self._fed = 0  # how many drafts were fed into the cache by the last propose
        # the `DraftBatch` holding this row's K/V while it drafts batched (then `cache` is empty)
        self.batch: Any = None

    def _own(self) -> None:
        """Take the K/V back from a batch before using them alone."""
        if self.batch is not None:
            self.batch.leave(self)

    def model_part(self) -> ModelDraftSource | None:
        return self

    def batch_part(self, tokens: Sequence[int], n: int) -> ModelDraftSource | None:
        # penalties need each draft on the host before the next: those rows draft alone
        return self if n > 0 and not self.opts.has_penalties else None

    def prefill(self, tokens: Sequence[int]) -> None:
        self._own()
        # After a prefix-cache restore, `cached` already covers a prefix of the prompt.
        head = list(tokens[len(self.cached) : -1])
        if head:
            feed(self.model, self.cache, head)
            mx.eval([c.state for c in self.cache])
        self.cached = list(tokens[:-1])

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        self._drafts, self._fed = None, 0
        if n <= 0:
            return Draft.empty(self.name)
        self._own()
        missing = list(tokens[len(self.cached) :])
        logits = feed(self.model, self.cache, missing)
        self.cached = list(tokens)
        eager = self.opts.has_penalties  # penalties need each draft on the host
        drafted: list[mx.array] = []
        host: list[int] = []
        reach = 1.0
        for i in range(n):
            # the same position noise as the target's: where q is near p, the choices agree
            tok = next_tokens(logits, tokens, host, self.opts, self.rng, len(tokens) + i)
            drafted.append(tok)
            last = i == n - 1
            gate = self.gate if not last else None
            sure = confidence(logits, tok, [self.opts]) if gate is not None else None
            if eager:
                host.append(to_int(tok))
            else:  # the device runs this draft step while the host builds the next one
                mx.async_eval(tok, *([sure] if sure is not None else []))
            if last:
                break
            if gate is not None and sure is not None:  # read once this step is done
                reach *= to_floats(sure)[0]
                if not gate.goes_on([reach], i + 1):
                    self.cut += 1
                    break
            logits = self._step(tok[None])
            self._fed += 1
        self._drafts = mx.concatenate(drafted).astype(mx.uint32)
        return Draft(self._drafts, len(drafted), self.name)

    def _step(self, tok: mx.array) -> mx.array:
        """The draft's logits (1, V) after `tok` (1, 1): compiled where it may be."""
        return compiledstep.forward(self.model, self.cache, tok, self.compiled)[0, -1:, :]

    def accept(self, tokens: Sequence[int]) -> None:
        # the drafts read whole (a slice would be evaluated behind what was queued since)
        fed = to_ints(self._drafts)[: self._fed] if self._drafts is not None and self._fed else []
        have = self.cached + fed
        keep = len(self.cached)
        if list(tokens[:keep]) != self.cached:  # it read drafts ahead (forced tokens) refused
            pairs = enumerate(zip(self.cached, tokens, strict=False))
            keep = next((i for i, (a, b) in pairs if a != b), min(keep, len(tokens)))
        while keep < len(have) and keep < len(tokens) and have[keep] == tokens[keep]:
            keep += 1
        self._drafts, self._fed = None, 0
        if self.batch is not None:  # the batch drops the rest when it next needs the row
            self.cached = list(tokens[:keep])
            return
        trimmed = trim_prompt_cache(self.cache, len(have) - keep)
        if trimmed != len(have) - keep:
            raise RuntimeError("draft cache cannot be trimmed")
        self.cached = list(tokens[:keep])
        self._drafts, self._fed = None, 0

    def lag(self, tokens: Sequence[int]) -> int:
        return len(tokens) - len(self.cached)

    def checkpoint(self) -> Any:
        """The draft's caches and the tokens they hold (shared, not copied: the prefix cache
        slices what it keeps)."""
        self._own()
        return (self.cache, list(self.cached))

    def restore(self, state: Any) -> None:
        self._own()
        cache, cached = state
        self.cache, self.cached = cache, list(cached)

    def dispose(self) -> None:
        if self.batch is not None:
            self.batch.leave(self, keep=False)
        self.cache, self.cached, self._drafts = [], [], None


RECENT = 4  # occurrences of an n-gram that prompt lookup keeps as candidates


class LookupDraftSource(DraftSource):
    """Prompt lookup: continue the most recent earlier occurrence of the trailing n-gram.

    No model, no cache: strongest where output copies input (code edits, RAG, repetition).
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.index: dict[tuple[int, ...], int] = {}
        # the occurrences before the latest, latest last (`alternatives`)
        self.earlier: dict[tuple[int, ...], list[int]] = {}
        self.after: dict[int, int] = {}  # token -> where its latest occurrence continues
        self._indexed = 0  # n-grams ending before this position are in the index

    def _extend(self, tokens: Sequence[int]) -> None:
        # Index every n-gram that ends before the last token: its latest occurrence, and a
        # few before it.
        for end in range(max(self._indexed, 1), len(tokens)):
            self.after[tokens[end - 1]] = end
            for g in range(self.min_ngram, self.max_ngram + 1):
                if end - g >= 0:
                    gram = tuple(tokens[end - g : end])
                    last = self.index.get(gram)
                    if last is not None:
                        earlier = self.earlier.setdefault(gram, [])
                        earlier.append(last)
                        del earlier[: -(RECENT - 1)]
                    self.index[gram] = end
        self._indexed = max(self._indexed, len(tokens))

    def prefill(self, tokens: Sequence[int]) -> None:
        self.index.clear()
        self.earlier.clear()
        self.after.clear()
        self._indexed = 0
        self._extend(tokens)

    def _match(self, tokens: Sequence[int], learn: bool = True) -> int | None:
        """Where the continuation of the longest trailing n-gram seen before starts; `learn`:
        index `tokens` first (committed ones only: the index never unlearns)."""
        if learn:
            self._extend(tokens)
        for g in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < g:
                continue
            pos = self.index.get(tuple(tokens[-g:]))
            if pos is not None and pos < len(tokens):
                return pos
        return None

    def has_draft(self, tokens: Sequence[int]) -> bool:
        return self._match(tokens) is not None

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        pos = self._match(tokens) if n > 0 else None
        if pos is None:
            return Draft.empty(self.name)
        cont = list(tokens[pos : pos + n])
        return Draft(mx.array(cont, dtype=mx.uint32), len(cont), self.name)

    def found(self, tokens: Sequence[int], n: int) -> int:
        """How many drafts `propose` would return (learning `tokens` as it does), without
        building them: a batch asks every row each round."""
        pos = self._match(tokens) if n > 0 else None
        return 0 if pos is None else min(n, len(tokens) - pos)

    def follow(self, tokens: Sequence[int], n: int) -> list[int]:
        pos = self._match(tokens, learn=False) if n > 0 else None
        return [] if pos is None else list(tokens[pos : pos + n])

    def filler(self, tokens: Sequence[int], n: int) -> list[int]:
        """`follow`'s continuation, else that of the last token's latest earlier occurrence:
        a match of one token is too weak to draft on (a lone row's rounds with such drafts ran
        at 1.14x plain decoding sampled against 1.34x without), but of held-out code prompts'
        steps without a longer match, continuing one was right for 0.62 tokens a step greedy
        and 0.35 sampled at 0.7 (the code pair's target, 8 tokens a step)."""
        pos = self._match(tokens, learn=False) if n > 0 else None
        if pos is None and n > 0 and tokens:
            pos = self.after.get(tokens[-1])
        return [] if pos is None or pos >= len(tokens) else list(tokens[pos : pos + n])

    def alternatives(self, tokens: Sequence[int], n: int, most: int) -> list[list[int]]:
        """Up to `most` distinct continuations of n tokens after `tokens`, `propose`'s first:
        every trailing n-gram seen before, longest first, each from its latest occurrence
        back."""
        found: list[list[int]] = []
        for g in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < g:
                continue
            gram = tuple(tokens[-g:])
            latest = self.index.get(gram)
            if latest is None:
                continue
            for pos in (latest, *reversed(self.earlier.get(gram, ()))):
                cont = list(tokens[pos : pos + n])
                if pos < len(tokens) and cont not in found:
                    found.append(cont)
                    if len(found) >= most:
                        return found
        return found

    def accept(self, tokens: Sequence[int]) -> None:
        self._extend(tokens)

    def dispose(self) -> None:
        self.index.clear()
        self.earlier.clear()
        self.after.clear()


class HybridDraftSource(DraftSource):
    """`auto` with a draft model: free prompt-lookup drafts when the text repeats, else the model."""

    name = "auto"

    def __init__(self, lookup: LookupDraftSource, model: ModelDraftSource, min_lookup: int = 3):
        self.lookup = lookup
        self.model = model
        self.min_lookup = min_lookup

    def prefill(self, tokens: Sequence[int]) -> None:
        self.lookup.prefill(tokens)
        self.model.prefill(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        found = self.lookup.propose(tokens, n)
        if found.count >= min(n, self.min_lookup):
            self.model._drafts, self.model._fed = None, 0
            return found
        return self.model.propose(tokens, n)

    def follow(self, tokens: Sequence[int], n: int) -> list[int]:
        """Lookup's tokens where `propose` would take them (long enough), else none."""
        found = self.lookup.follow(tokens, n)
        return found if len(found) >= min(n, self.min_lookup) else []

    def filler(self, tokens: Sequence[int], n: int) -> list[int]:
        return self.lookup.filler(tokens, n)

    def alternatives(self, tokens: Sequence[int], n: int, most: int) -> list[list[int]]:
        """Lookup's, where `propose` takes lookup's drafts."""
        found = self.lookup.alternatives(tokens, n, most)
        return found if found and len(found[0]) >= min(n, self.min_lookup) else []

    def model_part(self) -> ModelDraftSource | None:
        return self.model

    def batch_part(self, tokens: Sequence[int], n: int) -> ModelDraftSource | None:
        if not self.runs_model(tokens, n):
            return None  # free lookup drafts this round (`propose`)
        return self.model.batch_part(tokens, n)

    def runs_model(self, tokens: Sequence[int], n: int) -> bool:
        return self.lookup.found(tokens, n) < min(n, self.min_lookup)

    def accept(self, tokens: Sequence[int]) -> None:
        self.lookup.accept(tokens)
        self.model.accept(tokens)

    def cheaper(self) -> DraftSource | None:
        self.model.dispose()
        return self.lookup

    def lag(self, tokens: Sequence[int]) -> int:
        return self.model.lag(tokens)

    def checkpoint(self) -> Any:
        return self.model.checkpoint()

    def restore(self, state: Any) -> None:
        self.model.restore(state)

    def dispose(self) -> None:
        self.lookup.dispose()
        self.model.dispose()
