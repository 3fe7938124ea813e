"""A long prompt is read in chunks between the running rows' decode steps."""

from __future__ import annotations

import queue

from engine.events import Done, Event, GenerationRequest, TextChunk
from engine.options import parse_options
from engine.pairing import load_pairing
from engine.scheduler import PREFILL_CHUNK, Job, Scheduler
from engine.speculation import Costs
from registry.schema import ModelEntry
from tests.fixtures.tiny_models import TinyPair

COSTS = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.1)


def test_running_rows_decode_while_a_long_prompt_is_read(tiny_pair: TinyPair) -> None:
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), costs=COSTS)
    log: list[tuple[str, Event]] = []
    finished: list[str] = []
    jobs: queue.Queue[Job | None] = queue.Queue()
    long_prompt = [5 + i % 90 for i in range(8 * PREFILL_CHUNK)]
    for key, prompt, n in (("short", [5, 6, 7], 16), ("long", long_prompt, 3)):
        request = GenerationRequest(prompt, parse_options({"temperature": 0, "num_predict": n}))
        jobs.put(
            Job(
                request,
                emit=lambda e, k=key: log.append((k, e)),  # type: ignore[misc]
                done=lambda k=key: finished.append(k),  # type: ignore[misc]
            )
        )
    jobs.put(None)
    Scheduler(pairing, jobs, num_parallel=4).run()

    assert sorted(finished) == ["long", "short"]
    assert all(isinstance(e, Done) for k, e in log if not isinstance(e, TextChunk))
    first_long = next(i for i, (k, e) in enumerate(log) if k == "long")
    short_before = [e for k, e in log[:first_long] if k == "short"]
    # eight chunks for the long prompt; the short row decoded between them (text may merge
    # a few tokens into one chunk)
    assert len(short_before) >= 3
