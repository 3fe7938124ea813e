"""A request for its whole life in the scheduler: its job, output stream and decode state.

The decode state (`Generation`: target cache, draft source, committed tokens, randomness,
options, speculation state) travels with the row whether it is stepped alone or inside a
`RowBatch`; joining or leaving a batch moves only where its K/V live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlxd.engine.events import Event, GenerationRequest
from mlxd.engine.generation import Generation
from mlxd.engine.prefix_cache import Namespace
from mlxd.engine.rowstream import RowStream


@dataclass
class Job:
    request: GenerationRequest
    emit: Callable[[Event], None]
    done: Callable[[], None]  # called once, when the job leaves the scheduler


@dataclass
class Row:
    job: Job
    stream: RowStream
    gen: Generation
    ns: Namespace  # the target's prefix-cache namespace
    batched: bool = False  # its K/V sit in the scheduler's batch cache
    unoffered: bool = False  # its prompt is read but not yet offered to the prefix cache
    offered: int = 0  # tokens of its prompt in the prefix cache since its first token
    draft_revision: str = ""  # the draft model's prefix-cache attachments (with its adapter)
    release: list[Callable[[], None]] = field(default_factory=list)  # adapters it holds

    @property
    def request(self) -> GenerationRequest:
        return self.job.request

    @property
    def cancelled(self) -> bool:
        return self.job.request.cancel.is_set()

    def push(self, tokens: list[int]) -> bool:
        """Stream committed tokens; True once the row is finished (then `finish` it)."""
        return self.stream.push(tokens, self.gen.take_logprobs()) or self.gen.done

    def finish(self, reason: str | None = None) -> None:
        """Send the final event (the stream's own reason wins: stop string, EOS, cancel)."""
        self.stream.finish(reason or self.gen.finish or "length")
