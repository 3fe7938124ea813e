"""The draft-length controller: which k it picks, and when measured rounds turn it off."""

from __future__ import annotations

from mlxd.engine.speculation import Costs, DraftLengthController

# A compute-bound machine: every extra verify position costs about a third of a step.
LINEAR = Costs(
    verify={1: 1.0, 2: 1.3, 3: 1.62, 4: 1.95, 5: 2.3, 6: 2.65, 7: 3.0}, draft_step=0.12,
    plain_step=1.0,
)  # fmt: skip


def test_a_position_counts_as_tried_only_once_the_ones_before_it_were_accepted() -> None:
    """Acceptance by position is conditional: a draft rejected at its first token says nothing
    about its second, so long drafts are not undervalued by a squared falloff."""
    ctl = DraftLengthController(LINEAR, 6, 0.12)
    for _ in range(50):
        ctl.observe(4, 0)  # rejected at once
        ctl.observe(4, 4)  # all accepted
    assert ctl.tries[:4] == [100, 50, 50, 50]
    assert ctl.hits[:4] == [50, 50, 50, 50]
    alphas = ctl.alphas(4)
    assert alphas[0] < 0.55 and min(alphas[1:]) > 0.9
    assert ctl.choose() >= 3  # counting every proposed position would make it 1


def test_a_clear_winner_is_kept() -> None:
    ctl = DraftLengthController(LINEAR, 6, 0.12)
    for _ in range(100):
        ctl.observe(3, 0)
    assert ctl.choose() == 1


def test_a_short_unlucky_run_does_not_stop_speculation() -> None:
    """Rounds commit 1..k+1 tokens, so four rounds a little slower than plain decoding are
    noise; four rounds three times slower are not."""
    unlucky = DraftLengthController(LINEAR, 4, 0.12)
    for _ in range(unlucky.patience):
        unlucky.observe_time(2.16, 2)  # 8% slower than plain
    assert not unlucky.off
    for _ in range(60):  # ... but it lasts: now it is no longer noise
        if unlucky.off:
            break
        unlucky.observe_time(2.16, 2)
    assert unlucky.off
    losing = DraftLengthController(LINEAR, 4, 0.12)
    for _ in range(losing.patience):
        losing.observe_time(3.0, 1)
    assert losing.off


def _brute_force_choice(ctl: DraftLengthController) -> int:
    """The controller's objective, evaluated k by k (quadratic: small k only)."""
    return max(range(1, ctl.max_k + 1), key=ctl.expected_rate)


def test_the_choice_equals_the_best_k_by_the_cost_model() -> None:
    """Choosing k in one pass over the positions picks what evaluating every k picks."""
    for pattern in ([(4, 0), (4, 4)], [(3, 0)], [(6, 6)], [(6, 2), (6, 3)], []):
        ctl = DraftLengthController(LINEAR, 12, 0.12)
        for _ in range(20):
            for proposed, accepted in pattern:
                ctl.observe(proposed, accepted)
        assert ctl.choose() == _brute_force_choice(ctl)


def test_a_huge_draft_length_is_clamped_inside_the_engine() -> None:
    """A request asking for 100,000 drafts per round gets at most MAX_DRAFT_TOKENS: neither
    the choice (the search over k) nor a round (k draft forwards and a k+1-wide verify) grows
    with what was asked."""
    from mlxd.engine.speculation import MAX_DRAFT_TOKENS

    ctl = DraftLengthController(LINEAR, 100_000, 0.0)
    assert ctl.max_k == MAX_DRAFT_TOKENS
    assert len(ctl.hits) == len(ctl.tries) == MAX_DRAFT_TOKENS
    for _ in range(200):
        ctl.observe(ctl.max_k, ctl.max_k)  # drafts always accepted, and free
    assert 1 <= ctl.choose() <= MAX_DRAFT_TOKENS


def test_untried_positions_past_the_first_get_no_exploration_bonus() -> None:
    """Before any round, only the first position is explored optimistically: on a CPU-like
    curve (16 tokens cost 3.4 plain steps) free drafts start short, on a flat (GPU-like) one
    longer; rounds that land every draft widen the choice; a rejection at once narrows it."""
    steep = Costs(verify={1: 1.0, 2: 1.2, 3: 1.5, 4: 1.7, 8: 2.3, 16: 3.4}, plain_step=1.0)
    flat = Costs(verify={1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.3}, plain_step=1.0)
    first = DraftLengthController(steep, 15, 0.0)
    assert first.alphas(3, optimistic=True)[0] > first.alphas(3, optimistic=True)[1]
    assert first.choose() <= 4
    assert DraftLengthController(flat, 15, 0.0).choose() >= 2 * first.choose()
    copying = DraftLengthController(steep, 15, 0.0)
    for _ in range(6):
        copying.observe(copying.choose(), copying.choose())
    assert copying.choose() > first.choose()
    missing = DraftLengthController(steep, 15, 0.0)
    missing.observe(missing.choose(), 0)
    assert missing.choose() <= first.choose()


def test_free_drafts_of_a_model_source_are_chosen_as_a_lookup_row_would() -> None:
    """`auto`'s controller (a draft model's length, 4, and `free_k` 15) asks, where only its
    free drafts may run, for the length a free source with the same record would: longer
    than its own cap on a flat curve, positions past that cap inheriting the last estimate."""
    flat = Costs(verify={1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.3}, draft_step=0.3,
                 plain_step=1.0)  # fmt: skip
    auto = DraftLengthController(flat, 4, 0.3, free_k=15)
    lookup = DraftLengthController(flat, 15, 0.0)
    for ctl in (auto, lookup):
        for _ in range(6):
            ctl.observe(4, 4)
    assert auto.choose() <= 4 < auto.free_wanted() == lookup.choose()
    assert auto.alphas(15)[4:] == [auto.alphas(5)[4]] * 11
    assert DraftLengthController(flat, 4, 0.3).free_wanted() <= 4  # no free_k: its own cap
