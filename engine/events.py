"""Values that cross from the engine to the API: requests in, stream events out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.options import SamplingOptions
from mlxd.engine.speculation import SpecStats


@dataclass
class GenerationRequest:
    """A rendered, tokenized request; `cancel` is set by the API when the client goes away."""

    prompt_tokens: list[int]
    options: SamplingOptions
    started: float = field(default_factory=time.perf_counter)
    cancel: threading.Event = field(default_factory=threading.Event)
    load_duration: float = 0.0  # seconds spent loading the model for this request
    on_start: Callable[[], None] | None = None  # called once when it stops waiting in the queue

    def started_now(self) -> None:
        if self.on_start is not None:
            self.on_start()
            self.on_start = None


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class Metrics:
    """Ollama's metrics, in nanoseconds."""

    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int

    def as_dict(self) -> dict[str, int]:
        return {
            "total_duration": self.total_duration,
            "load_duration": self.load_duration,
            "prompt_eval_count": self.prompt_eval_count,
            "prompt_eval_duration": self.prompt_eval_duration,
            "eval_count": self.eval_count,
            "eval_duration": self.eval_duration,
        }


@dataclass(frozen=True)
class Done:
    done_reason: str  # "stop" | "length"
    metrics: Metrics
    output_tokens: list[int]
    speculation: SpecStats
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache

    def speculation_fields(self) -> dict[str, Any]:
        """mlxd's extra fields on the final object (clients ignore unknown keys)."""
        s = self.speculation
        out: dict[str, Any] = {"prompt_cache_tokens": self.cached_tokens, "draft_method": s.method}
        if s.method != "off":
            out.update(
                draft_count=s.drafted,
                draft_accepted=s.accepted,
                draft_acceptance_rate=round(s.acceptance_rate, 4),
                draft_tokens_per_round=round(s.tokens_per_round, 4),
                draft_acceptance_by_position=s.acceptance_by_position(),
            )
        if s.fallback_reason:
            out["draft_fallback_reason"] = s.fallback_reason
        if s.disabled_reason:
            out["draft_disabled_reason"] = s.disabled_reason
        return out


@dataclass(frozen=True)
class Failed:
    message: str


Event = TextChunk | Done | Failed
