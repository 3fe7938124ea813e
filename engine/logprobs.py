"""Log-probabilities of the committed tokens, for `logprobs` / `top_logprobs`.

A committed token's log-probability is read from the target's logits at the position it was
committed at: the logits the plain decoding step or the verify forward already computed, so
under speculation it is still the target's own distribution (never the draft's), and a
position's value is the same whichever path (solo, batched, speculating or not) committed it.

The distribution is the model's: the log-softmax of the target's raw logits, before the
request's penalties, temperature, top-k, top-p and min-p, as Ollama's runners and OpenAI
report log-probabilities (the same at any temperature, finite for every token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxd.engine.sampling import to_floats, to_ints

MAX_TOP_LOGPROBS = 20  # Ollama's and OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed position: its token id, log-probability and the k most likely ids."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprob:
    """A committed token's log-probability as the API writes it: the token's text and bytes."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class LogprobArrays:
    """Positions' log-probabilities on the device, not yet read: each position's chosen
    token's value (L,) and, with k > 0, its k most likely ids and their values (L, k)."""

    chosen: mx.array
    top_ids: mx.array | None = None
    top_values: mx.array | None = None

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]


def logprob_arrays(logits: mx.array, ids: mx.array, k: int) -> LogprobArrays:
    """Row i of `logits` (L, V) is the distribution token `ids[i]` ((n,) on the device, n <= L)
    was chosen from. Lazy: a decoding step issues them with its token, before it queues the
    next forward (read after it, they would be evaluated behind it)."""
    rows = logits[: ids.shape[0]].astype(mx.float32)
    rows = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(rows, ids.astype(mx.uint32)[:, None], axis=-1)[:, 0]
    k = min(max(k, 0), int(rows.shape[-1]))
    if k == 0:
        return LogprobArrays(chosen)
    top_ids = mx.argpartition(-rows, kth=k - 1, axis=-1)[:, :k]
    return LogprobArrays(chosen, top_ids, mx.take_along_axis(rows, top_ids, axis=-1))


def read_logprobs(found: LogprobArrays, tokens: Sequence[int]) -> list[TokenLogprob]:
    """The first len(`tokens`) positions of `found`, committed as `tokens`: one host sync."""
    if not tokens:
        return []
    mx.eval(found.arrays)
    values = to_floats(found.chosen)
    if found.top_ids is None or found.top_values is None:
        return [TokenLogprob(t, v) for t, v in zip(tokens, values, strict=False)]
    k = int(found.top_ids.shape[-1])
    all_ids, all_values = to_ints(found.top_ids), to_floats(found.top_values)
    out = []
    for n, (t, v) in enumerate(zip(tokens, values, strict=False)):
        pairs = zip(all_ids[n * k : (n + 1) * k], all_values[n * k : (n + 1) * k], strict=True)
        out.append(TokenLogprob(t, v, tuple(sorted(pairs, key=lambda p: -p[1]))))
    return out


def position_logprobs(logits: mx.array, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i of `logits` (L, V) is the distribution `tokens[i]` was committed from; one host
    sync for all of them."""
    if not tokens:
        return []
    return read_logprobs(logprob_arrays(logits, mx.array(list(tokens), dtype=mx.uint32), k), tokens)


def readable(
    entry: TokenLogprob,
    decode: Callable[[Sequence[int]], str],
    raw: Callable[[int], bytes] | None = None,
) -> Logprob:
    """`entry` with its tokens as text and bytes: `raw` gives a token's own bytes (a token
    that is part of a character decodes to U+FFFD; its bytes then say which part), so the
    bytes of consecutive tokens join into the text, and the text is what they decode to (a
    SentencePiece `▁world` is " world": decoded alone, the tokenizer drops its space)."""

    def one(token: int, logprob: float, top: tuple[Logprob, ...] = ()) -> Logprob:
        if raw is None:
            text = decode([token])
            data = text.encode("utf-8", "surrogatepass")
        else:
            data = raw(token)
            text = data.decode("utf-8", "replace")
        return Logprob(text, logprob, tuple(data), top)

    return one(entry.token, entry.logprob, tuple(one(t, v) for t, v in entry.top))
