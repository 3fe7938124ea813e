"""Values that cross from the engine to the API: requests in, stream events out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxd.engine.grammar import GrammarSpec
from mlxd.engine.logprobs import Logprob
from mlxd.engine.options import SamplingOptions
from mlxd.engine.speculation import SpecStats
from mlxd.registry.schema import AdapterRef


@dataclass
class GenerationRequest:
    """A rendered, tokenized request; `cancel` is set by the API when the client goes away."""

    prompt_tokens: list[int]
    options: SamplingOptions
    started: float = field(default_factory=time.perf_counter)
    cancel: threading.Event = field(default_factory=threading.Event)
    load_duration: float = 0.0  # seconds spent loading the model for this request
    on_start: Callable[[], None] | None = None  # called once when it stops waiting in the queue
    grammar: GrammarSpec | None = None  # structured output: the tokens the output must follow
    adapters: tuple[AdapterRef, ...] = ()  # mounted on the target for this request's row
    draft_adapters: tuple[AdapterRef, ...] = ()  # mounted on the draft model for it

    def started_now(self) -> None:
        if self.on_start is not None:
            self.on_start()
            self.on_start = None


@dataclass(frozen=True)
class TextChunk:
    text: str
    logprobs: tuple[Logprob, ...] = ()  # the tokens this text came from (top_logprobs set)


@dataclass(frozen=True)
class Metrics:
    """What one request cost: token counts and durations in nanoseconds (the API decides how
    they are written on the wire)."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int


@dataclass(frozen=True)
class Done:
    """The request's last event: why it ended, its metrics, its tokens and speculation's record."""

    done_reason: str  # "stop" | "length"
    metrics: Metrics
    output_tokens: list[int]
    speculation: SpecStats
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    # the text sent, where a stop string cut it short of `output_tokens` (they include the
    # tokens that wrote the stop): what a client continues from (Ollama's `context`)
    stopped_text: str | None = None


@dataclass(frozen=True)
class Failed:
    message: str
    by_request: bool = False  # the request's own input ended it (its grammar failed)
    closing: bool = False  # the daemon is stopping: no fault of the engine's or the request's


Event = TextChunk | Done | Failed
