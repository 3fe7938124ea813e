"""Several lookup candidates verified in one forward (`engine.branches`): each branch sees what
it would see alone, the cache keeps the winner's keys, and the output stays plain decoding's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, qwen2

from mlxd.engine import branches
from mlxd.engine.branches import branchable, grid_of, keep_branch, laid_out
from mlxd.engine.drafting import HybridDraftSource, LookupDraftSource, ModelDraftSource
from mlxd.engine.kvcache import make_cache, set_bucket
from mlxd.engine.pairing import Pairing, warm_up
from mlxd.engine.prefill import feed
from mlxd.engine.speculation import Costs
from tests.engine.conftest import FLAT, PIECES
from tests.engine.test_free_drafts import steps_of

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
LINEAR = Costs(verify={w: float(w) for w in range(1, 40)})  # every verified token costs


def tiny(kind: str = "llama", seed: int = 0) -> nn.Module:
    shape = dict(
        hidden_size=64, num_hidden_layers=3, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50,
    )  # fmt: skip
    mx.random.seed(seed)
    if kind == "qwen2":
        model: nn.Module = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **shape))  # type: ignore[arg-type]
    else:
        model = llama.Model(llama.ModelArgs(model_type="llama", **shape))  # type: ignore[arg-type]
    mx.eval(model.parameters())
    return model


def prefilled(model: nn.Module, tokens: list[int]) -> list:
    cache = make_cache(model)
    feed(model, cache, tokens)
    mx.eval([c.state for c in cache])
    return cache


GRID = grid_of(7, [8, 9, 10, 11], [[12, 13], [8, 9, 14, 15, 16], [8, 9, 10, 11]])


def test_a_grid_keeps_distinct_candidates_cut_or_padded_to_the_draft() -> None:
    assert GRID.drafts == ((8, 9, 10, 11), (12, 13, 13, 13), (8, 9, 14, 15))
    assert (GRID.count, GRID.length, GRID.width) == (3, 4, 5)
    assert GRID.tokens[:6] == [7, 8, 9, 10, 11, 7]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("bucket", [None, 32])
def test_each_branch_sees_what_it_would_alone(kind: str, bucket: int | None) -> None:
    """The grid's logits, branch by branch, equal a verify forward over that branch alone, on
    exact caches (a CPU's) and bucketed ones (a GPU's layout: whole buffers, array masks)."""
    model = tiny(kind)
    set_bucket(model, bucket)
    cache = prefilled(model, PROMPT)
    assert branchable(model, cache)
    with laid_out(model, cache, GRID):
        together = model(mx.array([GRID.tokens]), cache=cache)[0]
    for b, drafts in enumerate(GRID.drafts):
        alone = model(mx.array([[GRID.pending, *drafts]]), cache=prefilled(model, PROMPT))[0]
        part = together[b * GRID.width : (b + 1) * GRID.width]
        # exact on a CPU; a GPU's float32 matmuls of 15 and of 5 rows round apart (~1e-4)
        assert mx.allclose(part, alone, atol=1e-3).item(), (kind, bucket, b)
    # the layout is gone afterwards: a plain forward is plain again
    assert "make_mask" not in vars(cache[0])
    assert all(type(m["rope"]) is not branches._BranchRoPE for m in branches._rope_owners(model))


@pytest.mark.parametrize("bucket", [None, 32])
@pytest.mark.parametrize("branch", [0, 2])
def test_the_cache_keeps_the_winners_keys_only(branch: int, bucket: int | None) -> None:
    model = tiny()
    set_bucket(model, bucket)
    cache = prefilled(model, PROMPT)
    start = cache[0].offset
    with laid_out(model, cache, GRID):
        mx.eval(model(mx.array([GRID.tokens]), cache=cache))
    keep_branch(cache, start, branch, GRID.width, 3)  # pending + 2 accepted drafts
    expected = prefilled(model, [*PROMPT, GRID.pending, *GRID.drafts[branch][:2]])
    assert cache[0].offset == expected[0].offset == start + 3
    for got, want in zip(cache, expected, strict=True):
        end = want.offset
        assert mx.allclose(got.keys[..., :end, :], want.keys[..., :end, :], atol=1e-5).item()
        assert mx.allclose(got.values[..., :end, :], want.values[..., :end, :], atol=1e-5).item()


def test_lookup_offers_earlier_occurrences_longest_ngram_first() -> None:
    lookup = LookupDraftSource()
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 8, 0, 3, 4, 6, 6, 2, 3, 4]
    lookup.prefill(tokens)
    found = lookup.alternatives(tokens, 2, 4)
    assert found[0] == lookup.propose(tokens, 2).tokens.tolist() == [7, 8]  # "2 3 4", latest
    assert found == [[7, 8], [5, 6], [6, 6]]  # then earlier "2 3 4", then "3 4"
    assert lookup.alternatives(tokens, 2, 2) == [[7, 8], [5, 6]]
    assert lookup.alternatives([*tokens, 99], 2, 4) == []

    class NoModel(ModelDraftSource):
        def __init__(self) -> None:  # never runs: lookup's drafts are long enough
            pass

    auto = HybridDraftSource(lookup, NoModel(), min_lookup=2)
    assert auto.alternatives(tokens, 2, 4) == found
    short = [5, 1, 2, 1, 2]  # "1 2" goes on for two tokens only: `auto` would run its model
    auto.lookup.prefill(short)
    assert HybridDraftSource(auto.lookup, NoModel(), min_lookup=3).alternatives(short, 4, 4) == []


def test_branches_come_from_the_cost_curve() -> None:
    assert FLAT.branches(5, 4) == 4
    assert LINEAR.branches(5, 4) == 1
    assert Costs(verify={1: 1.0, 4: 1.0, 8: 1.05, 12: 2.0}).branches(4, 4) == 2


@pytest.mark.parametrize("options", [{}, {"temperature": 0.7, "seed": 3}])
def test_an_earlier_occurrence_is_verified_beside_the_latest(
    copier: Pairing, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt ends in "w01 w02 w03 w04", whose latest occurrence went on with "jjjj" and an
    earlier one with "w05 w06 ...", what the model writes: lookup's own draft is rejected at
    once, the earlier occurrence's branch is accepted, and the tokens are plain decoding's."""
    text = "@" + "".join(PIECES[:12]) + "x" + "".join(PIECES[1:5]) + "jjjj@" + "".join(PIECES[:5])
    prompt = list(copier.tokenizer.encode(text, add_special_tokens=False))
    plain = steps_of(copier, prompt, draft_method="off", **options)
    alone = steps_of(copier, prompt, draft_method="lookup", **options)  # one branch, the default
    monkeypatch.setattr(branches, "MAX_BRANCHES", 4)
    looked = steps_of(copier, prompt, draft_method="lookup", **options)

    def flat(steps: list[list[int]]) -> list[int]:
        return [t for new in steps for t in new]

    assert flat(plain) == flat(looked) == flat(alone)
    assert copier.tokenizer.decode(flat(plain)).startswith("".join(PIECES[5:9]))
    assert len(alone[0]) == 1  # "j" drafted, rejected: the target's own token alone
    assert len(looked[0]) > 2  # the earlier occurrence's drafts, accepted
    assert len(looked) < len(alone)


class RopedBeforeTransposing(nn.Module):
    """A RoPE applied as if queries and keys were (B, T, H, D), as a model of another make
    might apply it: the grid layout would misplace its positions."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return self.inner(x.swapaxes(1, 2), offset=offset).swapaxes(1, 2)


def test_a_model_whose_grid_forward_differs_never_verifies_branches() -> None:
    model = tiny()
    for layer in model.model.layers:
        layer.self_attn.rope = RopedBeforeTransposing(layer.self_attn.rope)
    cache = prefilled(model, PROMPT)
    assert not branches.reproduces(model)
    assert not branchable(model, cache)
    assert branchable(tiny(seed=1), prefilled(tiny(seed=1), PROMPT))


@pytest.mark.parametrize(("costs", "checked"), [(FLAT, True), (LINEAR, None)])
def test_warm_up_checks_the_layout_only_where_branches_would_run(
    costs: Costs, checked: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(branches, "MAX_BRANCHES", 4)
    model = tiny(seed=2)
    warm_up(model, None, costs, max_k=1, context=16)
    assert branches._owners(model).checked is checked
