"""Forced tokens as free drafts: where the grammar allows exactly one continuation (braces,
quotes, the keys of a fixed schema) the tokens are proposed without running any draft model.

Wrapping another source, the forced tokens go first and the inner source drafts on from the
end of them; alone, rounds happen only where something is forced. A forced token is the only
one the mask allows, so the masked target always accepts it (whatever it would have sampled).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxd.engine.drafting import Draft, DraftSource
from mlxd.engine.grammar import Matcher


class ForcedDraftSource(DraftSource):
    """The grammar's forced tokens, then (optionally) an inner source's drafts after them."""

    def __init__(self, matcher: Matcher, inner: DraftSource | None = None) -> None:
        self.matcher = matcher
        self.inner = inner
        self.name = "forced" if inner is None else f"forced+{inner.name}"

    def prefill(self, tokens: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.prefill(tokens)

    def has_draft(self, tokens: Sequence[int]) -> bool:
        if self.matcher.forced():
            return True
        return self.inner is not None and self.inner.has_draft(tokens)

    def propose(self, tokens: Sequence[int], n: int) -> Draft:
        forced = self.matcher.forced()[: max(n, 0)]
        rest = n - len(forced)
        inner = (
            self.inner.propose([*tokens, *forced], rest)
            if self.inner is not None and rest > 0
            else Draft.empty()
        )
        if not forced:
            return Draft(inner.tokens, inner.count, inner.source or self.name)
        head = mx.array(forced, dtype=mx.uint32)
        joined = mx.concatenate([head, inner.tokens.astype(mx.uint32)]) if inner.count else head
        return Draft(joined, len(forced) + inner.count, self.name)

    def runs_model(self, tokens: Sequence[int], n: int) -> bool:
        forced = self.matcher.forced()[: max(n, 0)]
        if self.inner is None or len(forced) >= n:
            return False
        return self.inner.runs_model([*tokens, *forced], n - len(forced))

    def accept(self, tokens: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.accept(tokens)

    def cheaper(self) -> DraftSource | None:
        """The inner source's cheaper arm behind the forced tokens; forced tokens alone (free)
        when the inner source has none; nothing when this is forced tokens alone."""
        if self.inner is None:
            return None
        arm = self.inner.cheaper()
        if arm is None:
            self.inner.dispose()
        return ForcedDraftSource(self.matcher, arm)

    def checkpoint(self) -> Any:
        return self.inner.checkpoint() if self.inner is not None else None

    def restore(self, state: Any) -> None:
        if self.inner is not None:
            self.inner.restore(state)

    def dispose(self) -> None:
        if self.inner is not None:
            self.inner.dispose()
