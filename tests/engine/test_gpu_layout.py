"""The GPU's cache layout (bucketed KV buffers, power-of-two prefill) run on the CPU, so the
path every GPU request takes stays under test; the CPU itself serves with mlx-lm's exact caches.
"""

from __future__ import annotations

import queue
from dataclasses import replace

import pytest

from mlxd.engine.backend import Backend
from mlxd.engine.cache_use import namespace_for, restore
from mlxd.engine.drafting import ModelDraftSource
from mlxd.engine.events import Done, Event, GenerationRequest
from mlxd.engine.kvcache import BucketedKVCache, make_cache
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.sampling import Rng
from mlxd.engine.scheduler import Job, Scheduler, make_draft_source
from mlxd.engine.speculation import SourceRecord
from mlxd.registry.schema import ModelEntry
from tests.engine.conftest import Loaded
from tests.engine.test_scheduler_prefill import (
    COSTS,
    test_running_rows_decode_while_a_long_prompt_is_read,
)
from tests.engine.test_speculative import (
    test_failing_draft_falls_back_to_plain_decoding,
    test_greedy_parity_over_50_prompts,
    test_paused_speculation_resumes_and_stays_lossless,
)
from tests.fixtures.tiny_models import TinyPair

pytestmark = pytest.mark.usefixtures("gpu_layout")

__all__ = [
    "test_failing_draft_falls_back_to_plain_decoding",
    "test_greedy_parity_over_50_prompts",
    "test_paused_speculation_resumes_and_stays_lossless",
    "test_running_rows_decode_while_a_long_prompt_is_read",
]


def test_the_layout_is_in_force(loaded: Loaded, backend: Backend, tiny_pair: TinyPair) -> None:
    assert backend.kv_bucket
    assert isinstance(make_cache(loaded.target)[0], BucketedKVCache)
    assert make_cache(loaded.target)[0].step == backend.kv_bucket
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
    assert make_cache(pairing.target)[0].step == backend.kv_bucket


def serve(pairing: object, prefix: PrefixCache, prompts: list[list[int]]) -> list[Done]:
    """Run `prompts` through one scheduler (concurrently, as batch rows); their final events."""
    jobs: queue.Queue[Job | None] = queue.Queue()
    done: list[Done | None] = [None] * len(prompts)

    def emit(i: int, event: Event) -> None:
        if isinstance(event, Done):
            done[i] = event

    for i, prompt in enumerate(prompts):
        opts = parse_options({"temperature": 0, "num_predict": 12, "draft_method": "off"})
        jobs.put(Job(GenerationRequest(prompt, opts), lambda e, i=i: emit(i, e), lambda: None))
    jobs.put(None)
    Scheduler(pairing, jobs, prefix=prefix, num_parallel=4).run()  # type: ignore[arg-type]
    assert all(d is not None for d in done)
    return [d for d in done if d is not None]


@pytest.mark.parametrize("layout", ["exact", "bucketed"])
def test_batch_rows_restore_prefixes_and_match_solo_runs(
    tiny_pair: TinyPair, backend: Backend, layout: str
) -> None:
    chosen = backend if layout == "bucketed" else replace(backend, kv_bucket=None)
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), chosen, costs=COSTS)
    prompts = [[5 + (i * 7 + j) % 90 for j in range(150 + 20 * i)] for i in range(3)]
    alone = [serve(pairing, PrefixCache(0), [p])[0].output_tokens for p in prompts]
    prefix = PrefixCache(64 * 2**20)
    cold = serve(pairing, prefix, prompts)
    warm = serve(pairing, prefix, prompts)
    assert [d.output_tokens for d in cold] == alone
    assert [d.output_tokens for d in warm] == alone
    assert [d.cached_tokens for d in cold] == [0, 0, 0]
    assert all(d.cached_tokens >= 128 for d in warm)


def test_warming_the_batch_leaves_a_working_scheduler(
    tiny_pair: TinyPair, backend: Backend
) -> None:
    pairing = load_pairing(ModelEntry("t", str(tiny_pair.target)), backend, costs=COSTS)
    jobs: queue.Queue[Job | None] = queue.Queue()
    Scheduler(pairing, jobs, num_parallel=3).warm()
    prompts = [[5 + i, 6, 7] for i in range(3)]
    alone = [serve(pairing, PrefixCache(0), [p])[0].output_tokens for p in prompts]
    assert [d.output_tokens for d in serve(pairing, PrefixCache(0), prompts)] == alone


def test_a_paused_draft_still_stores_its_state_beside_the_target(
    tiny_pair: TinyPair, backend: Backend
) -> None:
    """The draft skips its prefill while speculation is paused, and is caught up before the
    prefix cache stores the row (after its response): the next request with the prompt
    restores the target's blocks and the draft's state attached to each, the prompt's partial
    last block included."""
    pairing = load_pairing(
        ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft)), backend, costs=COSTS
    )
    pairing.history.record("model/greedy", SourceRecord([1.0], [4.0], 2.0, 1.0))  # not paying
    prefix = PrefixCache(64 * 2**20)
    prompt = [5 + (j * 7) % 90 for j in range(150)]
    opts = parse_options({"temperature": 0, "num_predict": 12, "draft_method": "model"})
    jobs: queue.Queue[Job | None] = queue.Queue()
    done: list[Event] = []
    jobs.put(Job(GenerationRequest(prompt, opts), done.append, lambda: None))
    jobs.put(None)
    Scheduler(pairing, jobs, prefix=prefix, num_parallel=1).run()
    final = done[-1]
    assert isinstance(final, Done) and final.speculation.rounds == 0
    source, _ = make_draft_source(pairing, opts, Rng(0))
    assert isinstance(source, ModelDraftSource)
    target, tokens = restore(prefix, namespace_for(pairing, opts), pairing, prompt, source)
    assert target is not None and tokens == len(prompt) - 1
    assert source.cached == prompt[:-1]
