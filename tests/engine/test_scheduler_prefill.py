"""A long prompt is read in chunks between the running rows' decode steps."""

from __future__ import annotations

import queue
import time

import pytest

import mlxd.engine.scheduler as scheduler_module
from mlxd.engine.backend import Backend, configure_backend
from mlxd.engine.events import Done, Event, GenerationRequest, TextChunk
from mlxd.engine.generation import Generation
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import load_pairing
from mlxd.engine.prefill import feed_rows
from mlxd.engine.scheduler import PREFILL_CHUNK, Job, Joining, Scheduler
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import TinyPair

COSTS = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.1)


def test_running_rows_decode_while_a_long_prompt_is_read(
    tiny_pair: TinyPair, backend: Backend
) -> None:
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
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


class _JoinLog(Scheduler):
    joins: list[int]

    def _insert(self, joining: list[Joining]) -> None:
        self.joins.append(len(joining))
        super()._insert(joining)


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_short_prompts_arriving_together_join_the_batch_together(
    tiny_pair: TinyPair,
    layout: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short prompts waiting together are read as rows of one forward and join in one more,
    so the last of a burst does not wait a forward per request ahead of it; each still decodes
    as it would alone (prompts of different lengths: the padding is invisible)."""
    backend = request.getfixturevalue("gpu_layout") if layout == "gpu" else configure_backend()
    groups: list[int] = []
    monkeypatch.setattr(
        scheduler_module, "feed_rows", lambda m, c, p: (groups.append(len(p)), feed_rows(m, c, p))
    )
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
    opts = parse_options({"temperature": 0, "num_predict": 6})
    prompts = [[5 + i, 9, *range(20, 20 + 3 * i), 11 + 2 * i, 13] for i in range(4)]

    def run(batch: list[list[int]], num_parallel: int) -> tuple[list[list[int]], list[int]]:
        outputs: dict[int, list[int]] = {}
        jobs: queue.Queue[Job | None] = queue.Queue()
        for i, prompt in enumerate(batch):

            def emit(event: Event, i: int = i) -> None:
                if isinstance(event, Done):
                    outputs[i] = event.output_tokens

            jobs.put(Job(GenerationRequest(prompt, opts), emit, lambda: None))
        jobs.put(None)
        scheduler = _JoinLog(pairing, jobs, num_parallel=num_parallel)
        scheduler.joins = []
        scheduler.run()
        return [outputs[i] for i in range(len(batch))], scheduler.joins

    together, joins = run(prompts, num_parallel=4)
    assert joins == [4]
    assert groups == [4]
    assert together == [run([p], num_parallel=1)[0][0] for p in prompts]


class _Arrivals(Scheduler):
    """Requests `later` arrive while the first prompts are read; notes each step's rows."""

    later: list[Job]
    stepped: list[int]

    def _prefill_step(self) -> None:
        super()._prefill_step()
        while self.later:
            self.jobs.put(self.later.pop(0))

    def _step(self) -> None:
        self.stepped.append(len(self.rows))
        super()._step()


def test_prompts_arriving_while_a_burst_is_read_start_in_its_first_round(
    tiny_pair: TinyPair, backend: Backend
) -> None:
    """Clients released together reach the runner a few milliseconds apart: those that arrive
    while the first prompts are read are read before any row decodes, so every row's first
    token comes from one round. A lone request with nothing arriving steps as soon as it is
    read. Outputs are each prompt's own."""
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
    opts = parse_options({"temperature": 0, "num_predict": 5})
    prompts = [[5 + i, 9, *range(20, 20 + 3 * i), 13] for i in range(5)]

    def run(first: list[list[int]], later: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        outputs: dict[int, list[int]] = {}
        jobs: queue.Queue[Job | None] = queue.Queue()

        def job(i: int, prompt: list[int]) -> Job:
            def emit(event: Event) -> None:
                if isinstance(event, Done):
                    outputs[i] = event.output_tokens

            return Job(GenerationRequest(prompt, opts), emit, lambda: None)

        for i, p in enumerate(first):
            jobs.put(job(i, p))
        scheduler = _Arrivals(pairing, jobs, num_parallel=8)
        scheduler.later = [job(len(first) + i, p) for i, p in enumerate(later)]
        scheduler.later.append(None)  # type: ignore[arg-type]  # the stop marker, last
        scheduler.stepped = []
        scheduler.run()
        return scheduler.stepped, [outputs[i] for i in range(len(first) + len(later))]

    stepped, together = run(prompts[:2], prompts[2:])
    assert stepped[0] == 5
    assert together == [run([p], [])[1][0] for p in prompts]
    alone, _ = run(prompts[:1], [])
    assert alone[0] == 1


def test_prompt_evaluation_lasts_until_the_first_token_is_read(
    tiny_pair: TinyPair, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's forwards are queued, not waited for, when it is in the cache; the device
    runs them until the first token is read. Here the first step stands for that wait (it
    takes 0.3 s): it is the prompt's evaluation, not decoding's, as Ollama reports it."""
    original = Generation._plain_step
    slept: list[bool] = []

    def slow_first(self: Generation, ahead: object) -> list[int]:
        if not slept:
            slept.append(True)
            time.sleep(0.3)
        return original(self, ahead)

    monkeypatch.setattr(Generation, "_plain_step", slow_first)
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
    events: list[Event] = []
    jobs: queue.Queue[Job | None] = queue.Queue()
    request = GenerationRequest([5, 6, 7], parse_options({"temperature": 0, "num_predict": 4}))
    jobs.put(Job(request, emit=events.append, done=lambda: None))
    jobs.put(None)
    Scheduler(pairing, jobs, num_parallel=4).run()
    done = next(e for e in events if isinstance(e, Done))
    assert done.metrics.prompt_eval_duration >= 0.3e9
    assert done.metrics.eval_duration < 0.3e9
