"""One request's output side: tokens to text, stop strings, limits, metrics, the final event.

Shared by the solo (speculative) path and the batched path, so a request's stream looks the
same whichever path produced its tokens, and it can move from one to the other mid-stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mlxd.engine.events import Done, Event, GenerationRequest, Metrics, TextChunk
from mlxd.engine.logprobs import Logprob, TokenLogprob, readable
from mlxd.engine.speculation import SpecStats
from mlxd.engine.textstream import IncrementalDetokenizer, StopMatcher


@dataclass
class RowStream:
    request: GenerationRequest
    emit: Callable[[Event], None]
    decode: Callable[[Sequence[int]], str]
    eos: set[int]
    limit: int
    output: list[int] = field(default_factory=list)
    reason: str | None = None  # set once the row is finished
    cached_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    t_prefill: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    token_bytes: Callable[[int], bytes] | None = None  # a token's own bytes (logprobs)

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.decode)
        self._stops = StopMatcher(self.request.options.stop)
        self._logprobs: list[Logprob] = []  # of tokens whose text is held back
        self._sent: list[str] = []  # the text emitted so far

    def _take_logprobs(self) -> tuple[Logprob, ...]:
        taken, self._logprobs = tuple(self._logprobs), []
        return taken

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def prefilled(self) -> None:
        """The prompt is in the cache: prompt evaluation ends, decoding starts."""
        self.t_first = time.perf_counter()

    def push(self, tokens: Iterable[int], logprobs: Sequence[TokenLogprob] = ()) -> bool:
        """Stream new tokens (with their log-probabilities, when asked for: they travel with
        the next text sent); True once the row is finished (EOS, stop string, limit, cancel)."""
        if self.t_first is None:
            self.prefilled()
        for i, tok in enumerate(tokens):
            if self.finished:
                break
            if tok in self.eos:
                self.reason = "stop"
                break
            self.output.append(tok)
            if i < len(logprobs):
                self._logprobs.append(readable(logprobs[i], self.decode, self.token_bytes))
            text = self._stops.feed(self._detok.add(tok))
            if text:
                self._sent.append(text)
                self.emit(TextChunk(text, self._take_logprobs()))
            if self._stops.stopped:
                self.reason = "stop"
            elif len(self.output) >= self.limit:
                self.reason = "length"
        if self.request.cancel.is_set() and not self.finished:
            self.reason = "cancel"
        return self.finished

    def finish(self, reason: str | None = None) -> None:
        """Flush held text and send the final object (nothing is sent to a cancelled client)."""
        if reason is not None and self.reason is None:
            self.reason = reason
        if self.reason == "cancel":
            return
        if not self._stops.stopped:
            tail = self._stops.feed(self._detok.flush()) + self._stops.flush()
            if tail or self._logprobs:
                self._sent.append(tail)
                self.emit(TextChunk(tail, self._take_logprobs()))
        now = time.perf_counter()
        first = self.t_first if self.t_first is not None else now
        req = self.request
        metrics = Metrics(
            total_duration=int((now - req.started) * 1e9),
            load_duration=int(req.load_duration * 1e9),
            prompt_eval_count=len(req.prompt_tokens),
            prompt_eval_duration=int((first - self.t_prefill) * 1e9),
            eval_count=len(self.output),
            eval_duration=int((now - first) * 1e9),
        )
        done_reason = "length" if self.reason == "length" else "stop"
        cut = "".join(self._sent) if self._stops.stopped else None
        self.emit(
            Done(done_reason, metrics, list(self.output), self.stats, self.cached_tokens, cut)
        )
