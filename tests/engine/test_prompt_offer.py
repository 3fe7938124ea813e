"""When a prompt reaches the prefix cache: a lone row offers it after its first token went
out; a row cancelled before that still offers it; rows joining a batch offer it before."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine.backend import Backend
from mlxd.engine.events import Done, Event, GenerationRequest, TextChunk
from mlxd.engine.options import SamplingOptions, parse_options
from mlxd.engine.pairing import Pairing, load_pairing
from mlxd.engine.prefill import CHUNK
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.scheduler import Job, Scheduler
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import ModelEntry
from tests.fixtures.tiny_models import TARGET_SHAPE, TinyPair, build_model

COSTS = Costs(verify={w: 1.0 for w in range(1, 10)}, draft_step=0.1)
PROMPT = [5 + i % 90 for i in range(200)]


class _LoggedCache(PrefixCache):
    """A real prefix cache that also notes, in the scheduler's event log, when it stores."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(64 << 20, block=16)
        self.log = log

    def insert(self, key: str, block: Any, through: bool = True, under: Any = None) -> None:
        self.log.append("insert")
        super().insert(key, block, through, under)

    def insert_tail(self, parent: str, tail: Any, key: str, block: Any) -> None:
        self.log.append("tail")
        super().insert_tail(parent, tail, key, block)


@pytest.fixture
def pairing(tiny_pair: TinyPair, backend: Backend) -> Pairing:
    return load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)


def _run(
    pairing: Any, cache: PrefixCache, log: list[str], requests: list[GenerationRequest]
) -> list[Event]:
    events: list[Event] = []
    jobs: queue.Queue[Job | None] = queue.Queue()

    def emit(event: Event) -> None:
        events.append(event)
        log.append("token" if isinstance(event, TextChunk) else type(event).__name__)

    for request in requests:
        jobs.put(Job(request, emit, lambda: None))
    jobs.put(None)
    Scheduler(pairing, jobs, cache, num_parallel=4).run()
    return events


def _second_read(log: list[str]) -> int:
    """Where in the log the second prompt was read."""
    return [i for i, e in enumerate(log) if e == "prefill"][1]


def _cached(events: list[Event]) -> list[int]:
    return [e.cached_tokens for e in events if isinstance(e, Done)]


def test_a_lone_prompt_is_offered_after_its_first_token(pairing: Pairing) -> None:
    log: list[str] = []
    cache = _LoggedCache(log)
    opts = parse_options({"temperature": 0, "num_predict": 8, "draft_method": "off"})
    _run(pairing, cache, log, [GenerationRequest(PROMPT, opts)])
    assert "insert" in log
    assert log.index("token") < log.index("insert")
    again = _run(pairing, cache, [], [GenerationRequest(PROMPT, opts)])
    assert _cached(again) == [len(PROMPT) - 1]


def test_a_lone_row_cancelled_before_its_first_token_still_offers_its_prompt(
    pairing: Pairing,
) -> None:
    log: list[str] = []
    cache = _LoggedCache(log)
    opts = parse_options({"temperature": 0, "num_predict": 8})
    request = GenerationRequest(PROMPT, opts)
    # cancelled once its prompt is read, before it decodes: the row ends at its next step
    cancelled = _CancelAfterPrefill(pairing, cache, request)
    cancelled.run()
    assert cancelled.events == []  # nothing is sent to a client that went away
    assert "insert" in log
    opts_off = parse_options({"temperature": 0, "num_predict": 4, "draft_method": "off"})
    again = _run(pairing, cache, [], [GenerationRequest(PROMPT, opts_off)])
    assert _cached(again) == [len(PROMPT) - 1]


class _CancelAfterPrefill(Scheduler):
    def __init__(self, pairing: Any, cache: PrefixCache, request: GenerationRequest) -> None:
        self.events: list[Event] = []
        jobs: queue.Queue[Job | None] = queue.Queue()
        jobs.put(Job(request, self.events.append, lambda: None))
        jobs.put(None)
        super().__init__(pairing, jobs, cache, num_parallel=4)
        self.request = request

    def _prefill_step(self) -> None:
        super()._prefill_step()
        self.request.cancel.set()


def test_rows_joining_a_batch_offer_their_prompts_before_they_decode(pairing: Pairing) -> None:
    log: list[str] = []
    cache = _LoggedCache(log)
    opts = parse_options({"temperature": 0, "num_predict": 6})
    short = PROMPT[:100]  # read together as rows of one forward: they join together
    prompts = [short, [7, *short[1:]]]
    _run(pairing, cache, log, [GenerationRequest(p, opts) for p in prompts])
    # both prompts' blocks are stored before the first token streams
    first = log.index("token")
    assert log[:first].count("insert") >= 2 * (len(short) - 1) // 16
    again = _run(pairing, cache, [], [GenerationRequest(p, opts) for p in prompts])
    assert _cached(again) == [len(short) - 1] * 2


class _LoggedScheduler(Scheduler):
    """Notes in the log each step that reads a prompt."""

    def __init__(self, log: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def _prefill_step(self) -> None:
        self.log.append("prefill")
        super()._prefill_step()


def _run_one_at_a_time(
    pairing: Any, prompts: list[list[int]], opts: SamplingOptions
) -> tuple[list[str], list[Event]]:
    """The requests' events, one row at a time, and what the scheduler and cache did."""
    log: list[str] = []
    events: list[Event] = []
    jobs: queue.Queue[Job | None] = queue.Queue()
    for prompt in prompts:
        jobs.put(Job(GenerationRequest(prompt, opts), events.append, lambda: None))
    jobs.put(None)
    _LoggedScheduler(log, pairing, jobs, _LoggedCache(log), num_parallel=1).run()
    return log, events


def test_a_finished_row_offers_after_a_waiting_prompt_is_read_unless_it_would_hit(
    pairing: Pairing,
) -> None:
    """The cache work of a row that just answered waits behind the prompt of a request that
    was waiting meanwhile (its copies never delay that prompt), unless that prompt begins as
    the row's did: then the row offers first, and the prompt is restored, not recomputed."""
    one = parse_options({"temperature": 0, "num_predict": 1, "draft_method": "off"})
    other = [7 + i % 80 for i in range(120)]
    log, _ = _run_one_at_a_time(pairing, [PROMPT, other], one)
    assert log.count("prefill") == 2 and "insert" in log
    assert log.index("insert") > _second_read(log)

    log, events = _run_one_at_a_time(pairing, [PROMPT, PROMPT], one)
    assert log.index("insert") < _second_read(log)
    assert _cached(events) == [0, len(PROMPT) - 1]


class _StreamScheduler(Scheduler):
    """Notes the stream MLX work would go to in each part of the loop."""

    def __init__(self, seen: dict[str, set[str]], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen = seen

    def _note(self, part: str) -> None:
        self.seen.setdefault(part, set()).add(str(mx.default_stream(mx.default_device())))

    def _admit(self) -> None:
        self._note("admit")  # prefix-cache restores
        super()._admit()

    def _offer_finished(self, hits_only: bool = False) -> None:
        self._note("offer")
        super()._offer_finished(hits_only)

    def _prefill_step(self) -> None:
        self._note("prefill")
        super()._prefill_step()

    def _step(self) -> None:
        self._note("step")
        super()._step()


def test_every_part_of_the_loop_runs_on_the_schedulers_stream(pairing: Pairing) -> None:
    """Restores, offers, prompts and rounds all queue their MLX work on one stream: none of
    them waits on another across streams (a fence on MLX's CUDA build)."""
    opts = parse_options({"temperature": 0, "num_predict": 3})
    cache = PrefixCache(64 << 20, block=16)
    seen: dict[str, set[str]] = {}
    for _ in range(2):  # the second pass restores what the first offered
        jobs: queue.Queue[Job | None] = queue.Queue()
        for p in (PROMPT[:40], PROMPT[:40], PROMPT[50:90]):
            jobs.put(Job(GenerationRequest(p, opts), lambda e: None, lambda: None))
        jobs.put(None)
        scheduler = _StreamScheduler(seen, pairing, jobs, cache, num_parallel=4)
        seen.clear()
        scheduler.run()
    assert set(seen) == {"admit", "offer", "prefill", "step"}
    assert all(streams == {str(scheduler.stream)} for streams in seen.values()), seen


def test_a_prompt_sent_again_does_not_wait_for_the_final_offer_it_cannot_hit(
    pairing: Pairing,
) -> None:
    """A row offers its prompt after its first token; a request for the same prompt that
    waited meanwhile hits those blocks, so it is read before the row's final offer (which adds
    only the answer's blocks). A prompt that goes on into the answer still waits for them."""
    two = parse_options({"temperature": 0, "num_predict": 2, "draft_method": "off"})
    log, events = _run_one_at_a_time(pairing, [PROMPT, PROMPT], two)
    second = _second_read(log)
    assert log[:second].count("tail") == 1  # the prompt's partial block; the answer's came after
    assert _cached(events) == [0, len(PROMPT) - 1]

    answer = next(e.output_tokens for e in events if isinstance(e, Done))
    longer = [*PROMPT, *answer, 11]
    log, events = _run_one_at_a_time(pairing, [PROMPT, longer], two)
    second = _second_read(log)
    assert log[:second].count("tail") == 2  # the answer's partial block came before it was read
    assert _cached(events) == [0, len(PROMPT) + 1]  # all the first row's cache held


def test_prompts_shorter_than_a_block_are_all_restored_when_sent_again(pairing: Pairing) -> None:
    """Every prompt shorter than a block keeps its partial block under the namespace's root,
    beside its answer's: a burst of ten of them, sent again, is restored whole."""
    opts = parse_options({"temperature": 0, "num_predict": 4, "draft_method": "off"})
    prompts = [[5 + i, *PROMPT[i : i + 9]] for i in range(10)]  # 10 tokens; blocks of 16
    cache = PrefixCache(64 << 20, block=16)
    first = _run(pairing, cache, [], [GenerationRequest(p, opts) for p in prompts])
    assert _cached(first) == [0] * len(prompts)
    again = _run(pairing, cache, [], [GenerationRequest(p, opts) for p in prompts])
    assert _cached(again) == [len(p) - 1 for p in prompts]


class _CancelMidPrompt(Scheduler):
    """Cancels `request` once part of its prompt is read (a decoding row makes it read a
    chunk a step)."""

    def __init__(self, request: GenerationRequest, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request = request
        self.read = 0

    def _read_prompts(self) -> list[Any]:
        joining = super()._read_prompts()
        for p in self.prefilling:
            if p.row.request is self.request and p.fed and p.todo:
                self.read = len(p.fed)
                self.request.cancel.set()
        return joining


def test_a_prompt_cancelled_while_read_offers_what_was_read(pairing: Pairing) -> None:
    cache = PrefixCache(64 << 20, block=16)
    busy = parse_options({"temperature": 0, "num_predict": 40, "draft_method": "off"})
    opts = parse_options({"temperature": 0, "num_predict": 4, "draft_method": "off"})
    long = [5 + i % 90 for i in range(700)]
    request = GenerationRequest(long, opts)
    jobs: queue.Queue[Job | None] = queue.Queue()
    jobs.put(Job(GenerationRequest(PROMPT[:20], busy), lambda e: None, lambda: None))
    jobs.put(Job(request, lambda e: None, lambda: None))
    jobs.put(None)
    scheduler = _CancelMidPrompt(request, pairing, jobs, cache, num_parallel=4)
    scheduler.run()
    assert 0 < scheduler.read < len(long) - 1
    again = _run(pairing, cache, [], [GenerationRequest(long, opts)])
    assert _cached(again) == [scheduler.read // 16 * 16]


def test_a_lone_prompt_cancelled_while_read_stops_within_a_chunk(
    tmp_path: Path, backend: Backend
) -> None:
    """With no row decoding, a prompt is read a chunk a step: a client that leaves stops the
    read there (it read the whole prompt for nobody before, holding up every other request),
    and what was read is offered."""
    model = build_model(tmp_path, "long", seed=3, max_position_embeddings=4 * CHUNK, **TARGET_SHAPE)
    pairing = load_pairing(ModelEntry("long", str(model)), backend, costs=COSTS)
    cache = PrefixCache(256 << 20, block=16)
    opts = parse_options({"temperature": 0, "num_predict": 4, "draft_method": "off"})
    long = [5 + i % 90 for i in range(3 * CHUNK)]
    request = GenerationRequest(long, opts)
    jobs: queue.Queue[Job | None] = queue.Queue()
    jobs.put(Job(request, lambda e: None, lambda: None))
    jobs.put(None)
    scheduler = _CancelMidPrompt(request, pairing, jobs, cache, num_parallel=4)
    scheduler.run()
    assert scheduler.read == CHUNK
    again = _run(pairing, cache, [], [GenerationRequest(long, opts)])
    assert _cached(again) == [CHUNK]
