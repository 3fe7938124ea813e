"""A row's stream carries each token's text and its log-probability on the same chunk, also
where a stop string holds back part of a token's text (text goes by whole tokens then)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mlxd.engine.events import Event, GenerationRequest, TextChunk
from mlxd.engine.logprobs import TokenLogprob
from mlxd.engine.options import parse_options
from mlxd.engine.rowstream import RowStream

VOCAB = ["<eos>", " return", " np", ".", "array", "(", "x", ")", "☃", ""]  # 9: no text of its own


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def stream(tokens: list[int], stop: list[str], logprobs: bool) -> list[TextChunk]:
    events: list[Event] = []
    opts = parse_options({"stop": stop, "temperature": 0})
    row = RowStream(GenerationRequest([1], opts), events.append, decode, {0}, limit=100)
    values = [TokenLogprob(t, -0.5) for t in tokens] if logprobs else []
    for i, token in enumerate(tokens):  # one token a step, as decoding sends them
        if row.push([token], values[i : i + 1]):
            break
    row.finish()
    return [e for e in events if isinstance(e, TextChunk)]


SAID = [1, 2, 3, 4, 5, 6, 7]  # " return np.array(x)"


@pytest.mark.parametrize("stop", [["return☃"], ["np☃", "ay☃"], ["(x☃"], []])
def test_each_chunk_carries_its_own_tokens(stop: list[str]) -> None:
    chunks = stream(SAID, stop, logprobs=True)
    assert "".join(c.text for c in chunks) == decode(SAID)
    for c in chunks:
        assert c.text == "".join(lp.token for lp in c.logprobs)
    assert [lp.token for c in chunks for lp in c.logprobs] == [VOCAB[t] for t in SAID]


def test_without_logprobs_text_is_not_held_for_tokens() -> None:
    """Only the stop strings' own hold: ' ' of ' return' goes out at once."""
    chunks = stream(SAID, ["return☃"], logprobs=False)
    assert chunks[0].text == " "


def test_a_stop_sends_the_text_before_it_with_the_values_of_the_tokens_that_wrote_it() -> None:
    """` np` wrote the space kept; `☃` is wholly inside the stop: no text, no value (as
    Ollama trims its values after cutting a stop)."""
    chunks = stream([1, 2, 8, 3], ["np☃"], logprobs=True)
    assert "".join(c.text for c in chunks) == " return "
    assert [lp.token for c in chunks for lp in c.logprobs] == [" return", " np"]


@pytest.mark.parametrize("stop", [[], ["np☃"]])
def test_a_token_without_text_sends_its_value_with_the_next_text(stop: list[str]) -> None:
    chunks = stream([1, 9, 2, 9], stop, logprobs=True)
    assert "".join(c.text for c in chunks) == " return np"
    assert [lp.token for c in chunks for lp in c.logprobs] == [" return", "", " np", ""]


@pytest.mark.parametrize(("stop", "kept", "accepted"), [(["np"], 2, 2), ([")"], 7, 6), ([], 8, 6)])
def test_drafts_past_a_stop_are_not_counted_accepted(
    stop: list[str], kept: int, accepted: int
) -> None:
    """A round commits its accepted drafts, then the target's own token; where a stop string
    ends the row inside them, the drafts after it were never output: `draft_accepted` stays
    within `eval_count`, the positions' counts with it."""
    events: list[Event] = []
    opts = parse_options({"stop": stop, "temperature": 0})
    row = RowStream(GenerationRequest([1], opts), events.append, decode, {0}, limit=100)
    row.stats.observe(4, 4)  # " return np . array" drafted and accepted, "(" the target's
    row.push([1, 2, 3, 4, 5])
    row.stats.observe(3, 2)  # "x )" accepted, then the target's
    row.push([6, 7, 5])
    row.finish()
    done = events[-1]
    assert done.metrics.eval_count == kept  # type: ignore[attr-defined]
    assert row.stats.accepted == accepted <= kept
    assert sum(row.stats.accepted_at) == accepted
