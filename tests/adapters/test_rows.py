"""Rows on adapters: mlx-lm's own output per adapter, any mix of adapters in one batch."""

from __future__ import annotations

import queue
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlxd.engine.adapters import AdapterError
from mlxd.engine.backend import configure_backend
from mlxd.engine.batch import Committed, RowBatch
from mlxd.engine.events import Done, Event, Failed, GenerationRequest
from mlxd.engine.options import parse_options
from mlxd.engine.pairing import Pairing, load_pairing
from mlxd.engine.prefix_cache import PrefixCache
from mlxd.engine.scheduler import Job, Scheduler
from mlxd.engine.speculation import Costs
from mlxd.registry.schema import AdapterRef, ModelEntry
from tests.adapters.conftest import Adapters
from tests.fixtures.tiny_models import TinyPair

FLAT = Costs(verify={w: 1.0 for w in range(1, 40)}, draft_step=0.01)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [20 + i % 7 for i in range(30)], [9, 10, 11]]
TOKENS = 24


def reference(target: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from mlx-lm itself: `load(path, adapter_path=...)`, `generate_step`."""
    model, tokenizer = load(str(target), adapter_path=str(adapter) if adapter else None)[:2]
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0)):
        out.append(int(token))
        if int(token) in tokenizer.eos_token_ids:
            break
    return out


def run(pairing: Pairing, requests: list[GenerationRequest], **kw: object) -> list[Event]:
    """Queue every request at once on one scheduler (they share a batch); each one's last event."""
    jobs: queue.Queue[Job | None] = queue.Queue()
    last: dict[int, Event] = {}

    def emit(i: int) -> object:
        def put(event: Event) -> None:
            if isinstance(event, Done | Failed):
                last[i] = event

        return put

    def finished() -> None:
        if len(last) == len(requests):
            jobs.put(None)

    for i, req in enumerate(requests):
        jobs.put(Job(req, emit(i), finished))  # type: ignore[arg-type]
    Scheduler(pairing, jobs, **kw).run()  # type: ignore[arg-type]
    return [last[i] for i in range(len(requests))]


def request(prompt: list[int], adapter: Path | None = None, **opts: object) -> GenerationRequest:
    options = parse_options({"temperature": 0, "num_predict": TOKENS, **opts})
    refs = (AdapterRef(str(adapter)),) if adapter else ()
    return GenerationRequest(list(prompt), options, adapters=refs)


def tokens(event: Event) -> list[int]:
    assert isinstance(event, Done), event
    return event.output_tokens


@pytest.fixture(scope="module")
def pairing(tiny_pair: TinyPair) -> Pairing:
    entry = ModelEntry("p", str(tiny_pair.target), draft=str(tiny_pair.draft))
    return load_pairing(entry, configure_backend(), costs=FLAT)


@pytest.mark.parametrize("which", ["sql", "dora", None])
@pytest.mark.parametrize("method", ["off", "model"])
def test_a_row_on_an_adapter_decodes_as_mlx_lm_with_that_adapter(
    pairing: Pairing, tiny_pair: TinyPair, adapters: Adapters, which: str | None, method: str
) -> None:
    adapter = getattr(adapters, which) if which else None
    prompt = PROMPTS[0]
    [event] = run(pairing, [request(prompt, adapter, draft_method=method)])
    assert tokens(event) == reference(tiny_pair.target, adapter, prompt, TOKENS)
    if which is not None:
        assert tokens(event) != reference(tiny_pair.target, None, prompt, TOKENS)


@pytest.fixture
def widths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every batch round run (plain, pipelined or drafting)."""
    seen: list[int] = []
    round_ = RowBatch.round

    def recorded(self: RowBatch) -> list[Committed]:
        seen.append(len(self.gens))
        return round_(self)

    monkeypatch.setattr(RowBatch, "round", recorded)
    return seen


def test_rows_of_two_adapters_and_the_base_share_a_batch_and_each_gets_its_solo_output(
    pairing: Pairing, adapters: Adapters, widths: list[int]
) -> None:
    mix = [adapters.sql, None, adapters.tests, adapters.dora, adapters.sql, None]
    reqs = [request(PROMPTS[i % 3], a) for i, a in enumerate(mix)]
    batched = run(pairing, reqs, num_parallel=8)
    assert max(widths) == len(mix)  # every row was in one batch forward
    for i, adapter in enumerate(mix):
        [solo] = run(pairing, [request(PROMPTS[i % 3], adapter)])
        assert tokens(batched[i]) == tokens(solo)
    outputs = {tuple(tokens(batched[i])) for i in range(3)}
    assert len(outputs) == 3  # same prompt family, three different models


def test_a_batch_of_rows_on_one_adapter_gives_each_row_its_solo_output(
    pairing: Pairing, adapters: Adapters, widths: list[int]
) -> None:
    reqs = [request(PROMPTS[i], adapters.sql) for i in range(3)]
    batched = run(pairing, reqs, num_parallel=8)
    assert max(widths) == 3  # one forward for all three rows, each layer on one adapter
    for i in range(3):
        [solo] = run(pairing, [request(PROMPTS[i], adapters.sql)])
        assert tokens(batched[i]) == tokens(solo)


def test_adapters_stay_resident_within_their_budget_and_the_base_is_never_touched(
    tiny_pair: TinyPair, adapters: Adapters
) -> None:
    entry = ModelEntry("p", str(tiny_pair.target))
    pairing = load_pairing(entry, configure_backend(), costs=FLAT)
    one = pairing.adapters.acquire((AdapterRef(str(adapters.sql)),))
    size = one.mount.nbytes
    pairing.adapters.release(one)
    pairing.adapters.max_bytes = size * 2  # room for two
    for path in (adapters.tests, adapters.sql, adapters.dora):
        view = pairing.adapters.acquire((AdapterRef(str(path)),))
        pairing.adapters.release(view)
    assert pairing.adapters.nbytes <= size * 2
    revisions = [m.revision for m in pairing.adapters.mounted()]
    assert len(revisions) == 2 and one.mount.revision in revisions  # sql was used last but one
    [event] = run(pairing, [request(PROMPTS[2], adapters.tests)])  # dropped: mounted again
    assert tokens(event) == reference(tiny_pair.target, adapters.tests, PROMPTS[2], TOKENS)
    [event] = run(pairing, [request(PROMPTS[2])])
    assert tokens(event) == reference(tiny_pair.target, None, PROMPTS[2], TOKENS)


def test_an_adapter_for_another_base_is_refused_and_the_row_fails_alone(
    pairing: Pairing, adapters: Adapters
) -> None:
    with pytest.raises(AdapterError, match="does not fit"):
        pairing.adapters.acquire((AdapterRef(str(adapters.other_base)),))
    bad, good = run(pairing, [request(PROMPTS[0], adapters.other_base), request(PROMPTS[0])])
    assert isinstance(bad, Failed) and "does not fit" in bad.message
    assert isinstance(good, Done)


def test_the_draft_drafts_without_the_adapter_or_with_its_own(
    pairing: Pairing, tiny_pair: TinyPair, adapters: Adapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXD_SPEC_FLOOR", "0")  # drafting itself is pinned here, not its speed
    want = reference(tiny_pair.target, adapters.sql, PROMPTS[1], TOKENS)
    plain = request(PROMPTS[1], adapters.sql, draft_method="model")
    drafted = request(PROMPTS[1], adapters.sql, draft_method="model")
    drafted.draft_adapters = (AdapterRef(str(adapters.draft)),)
    a, b = run(pairing, [plain]), run(pairing, [drafted])
    assert tokens(a[0]) == want and tokens(b[0]) == want
    assert isinstance(a[0], Done) and a[0].speculation.rounds > 0


def test_prefix_blocks_are_never_shared_between_adapters_and_survive_a_restart(
    pairing: Pairing, tiny_pair: TinyPair, adapters: Adapters, tmp_path: Path
) -> None:
    prompt = [40 + i % 9 for i in range(33)]
    order = [None, adapters.sql, adapters.tests, adapters.sql, None, adapters.tests]
    prefix = PrefixCache(1 << 26, tmp_path / "ssd", 1 << 26, block=8)
    hits, outputs = [], []
    for adapter in order:
        [event] = run(pairing, [request(prompt, adapter)], prefix=prefix)
        hits.append(event.cached_tokens if isinstance(event, Done) else -1)
        outputs.append(tokens(event))
    assert hits[:3] == [0, 0, 0]  # same prompt, three namespaces: nothing shared
    assert min(hits[3:]) >= 32  # each namespace hits its own blocks
    assert outputs[3] == outputs[1] and outputs[4] == outputs[0] and outputs[5] == outputs[2]
    prefix.close()  # the daemon stops; a new one opens the same SSD tier with a fresh base
    again = load_pairing(ModelEntry("p", str(tiny_pair.target)), configure_backend(), costs=FLAT)
    prefix = PrefixCache(1 << 26, tmp_path / "ssd", 1 << 26, block=8)
    try:
        for adapter, before in zip(order[:3], outputs[:3], strict=True):
            [event] = run(again, [request(prompt, adapter)], prefix=prefix)
            assert isinstance(event, Done) and event.cached_tokens >= 32
            assert event.output_tokens == before
        assert prefix.stats.ssd_hit_blocks >= 3 * 4  # from the SSD tier: the RAM tier was new
    finally:
        prefix.close()
