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
        # tokens not sent yet: where each one's text ends in the text decoded so far, where
        # its own text starts (`_within`), and its log-probability (only where asked for)
        self._logprobs: list[tuple[int, int, Logprob]] = []
        self._last_end = 0  # where the text of the last token given a value ends
        self._decoded = 0  # characters decoded so far
        self._ready = ""  # text the stop strings released, not sent yet
        self._sent: list[str] = []  # the text emitted so far
        self._sent_chars = 0
        self._accepted = 0  # `stats.accepted` as of the last push

    def _send(self, text: str, final: bool = False) -> None:
        """Send released text with the log-probabilities of the tokens it completes. Where
        they are asked for, text goes by whole tokens: a token whose text the stop strings
        hold in part (a stop's possible start) waits whole, so each chunk carries its tokens'
        text and their values together, as Ollama's do. `final`: everything goes."""
        self._ready += text
        if final:
            cut = len(self._ready)
        else:
            ready = self._sent_chars + len(self._ready)
            ends = [end for end, _, _ in self._logprobs if end <= ready]
            whole = len(ends) == len(self._logprobs)
            cut = (
                len(self._ready)
                if whole
                else max(ends, default=self._sent_chars) - self._sent_chars
            )
        if cut <= 0 and not (final and self._logprobs):
            return  # values of tokens with no text of their own go with the next text
        chunk, self._ready = self._ready[:cut], self._ready[cut:]
        self._sent_chars += len(chunk)
        pending = self._within() if final and self._stops.stopped else self._logprobs
        taken = [lp for end, _, lp in pending if final or end <= self._sent_chars]
        self._logprobs = pending[len(taken) :]
        self._sent.append(chunk)
        self.emit(TextChunk(chunk, tuple(taken)))

    def _within(self) -> list[tuple[int, int, Logprob]]:
        """The tokens not sent yet whose own text starts within the text sent: one wholly past
        a stop string's cut gave the reply nothing (as Ollama trims its values after the cut)."""
        return [e for e in self._logprobs if e[1] < self._sent_chars]

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def push(self, tokens: Iterable[int], logprobs: Sequence[TokenLogprob] = ()) -> bool:
        """Stream new tokens (with their log-probabilities, when asked for: they travel with
        the next text sent); True once the row is finished (EOS, stop string, limit, cancel)."""
        if self.t_first is None:
            # prompt evaluation ends with the first token on the host, as Ollama counts it
            # (its prompt's last batch yields that token's logits): the forwards reading the
            # prompt were only queued when the prompt was in, and run until this read
            self.t_first = time.perf_counter()
        tokens = list(tokens)
        kept = 0
        for i, tok in enumerate(tokens):
            if self.finished:
                break
            kept = i + 1
            if tok in self.eos:
                self.reason = "stop"
                break
            self.output.append(tok)
            piece = self._detok.add(tok)
            self._decoded += len(piece)
            if i < len(logprobs):
                value = readable(logprobs[i], self.decode, self.token_bytes)
                # its own text ends its piece (which may open with bytes held from before)
                start = max(self._decoded - len(value.token), self._last_end)
                self._logprobs.append((self._decoded, start, value))
                self._last_end = self._decoded
            self._send(self._stops.feed(piece), final=self._stops.stopped)
            if self._stops.stopped:
                self.reason = "stop"
            elif len(self.output) >= self.limit:
                self.reason = "length"
        self._uncount(kept)
        if self.request.cancel.is_set() and not self.finished:
            self.reason = "cancel"
        return self.finished

    def _uncount(self, kept: int) -> None:
        """A round's accepted drafts open its tokens; those past where the row ended (a stop
        string, EOS) were never output, so they do not count as accepted: `draft_accepted`
        stays within `eval_count`, as it does where the limit ends a row."""
        accepted = self.stats.accepted - self._accepted  # this push's round
        self.stats.drop_accepted(accepted - min(kept, accepted), accepted)
        self._accepted = self.stats.accepted

    def finish(self, reason: str | None = None) -> None:
        """Flush held text and send the final object (nothing is sent to a cancelled client)."""
        if reason is not None and self.reason is None:
            self.reason = reason
        if self.reason == "cancel":
            return
        if not self._stops.stopped:
            self._send(self._stops.feed(self._detok.flush()) + self._stops.flush(), final=True)
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
