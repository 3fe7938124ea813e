"""A lone row's log-probabilities, decoded plainly with the next forward queued ahead."""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import pytest

from mlxd.engine import generation as generation_module
from mlxd.engine.generation import Generation
from mlxd.engine.logprobs import LogprobArrays, position_logprobs
from mlxd.engine.options import parse_options
from mlxd.engine.sampling import Rng
from tests.engine.test_speculative import tiny_vocab_model
from tests.fixtures.issued import record_issued


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("k", [0, 3])
def test_a_steps_logprobs_are_issued_before_the_next_forward_and_are_the_models(
    monkeypatch: pytest.MonkeyPatch, temperature: float, k: int
) -> None:
    """Each plain step with log-probabilities wanted queues the next forward before it reads
    its token, as any plain step does, and the values it then reads were issued to the device
    before that forward: built after it, they would be evaluated behind it and the read would
    wait for it. They are the log-softmax of the logits each token was chosen from (the
    tokens read back through one forward of the whole text), the same tokens as decoding
    without them."""
    model = tiny_vocab_model(3, 12)
    prompt = [1, 4, 2, 7]
    opts = parse_options({"temperature": temperature, "seed": 5})
    read = generation_module.read_logprobs
    reads: list[bool] = []  # per read: the next forward was queued after its arrays

    def reading(found: LogprobArrays, tokens: list[int]) -> Any:
        assert all(id(a) in issued.at for a in found.arrays)
        reads.append(all(issued.before_latest(a) for a in found.arrays))
        return read(found, tokens)

    plain = Generation(model, prompt, opts, set(), 12, Rng(9))
    plain.prefill()
    alone = [t for new in plain for t in new]
    issued = record_issued(monkeypatch)
    monkeypatch.setattr(generation_module, "read_logprobs", reading)
    gen = Generation(model, prompt, dataclasses.replace(opts, top_logprobs=k), set(), 12, Rng(9))
    gen.prefill()
    tokens = [t for new in gen for t in new]
    assert tokens == alone
    assert len(reads) == len(tokens) and all(reads[:-1])  # the last step queues nothing
    logits = model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :]
    want = position_logprobs(logits, tokens, k)
    got = gen.take_logprobs()
    assert [t.token for t in got] == tokens
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
