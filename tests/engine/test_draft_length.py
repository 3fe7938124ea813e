"""The draft-length controller: which k it picks, and when measured rounds turn it off."""

from __future__ import annotations

from engine.speculation import Costs, DraftLengthController

# A compute-bound machine: every extra verify position costs about a third of a step.
LINEAR = Costs(
    verify={1: 1.0, 2: 1.3, 3: 1.62, 4: 1.95, 5: 2.3, 6: 2.65, 7: 3.0}, draft_step=0.12,
    plain_step=1.0,
)  # fmt: skip


def test_a_near_tie_goes_to_the_longer_draft() -> None:
    ctl = DraftLengthController(LINEAR, 6, 0.12)
    for _ in range(100):
        for accepted in (3, 3, 1, 3):
            ctl.observe(3, accepted)
    rates = {k: ctl.expected_rate(k) for k in range(1, 7)}
    assert max(rates, key=rates.__getitem__) == 2
    assert rates[3] >= 0.97 * rates[2] > rates[4]
    assert ctl.choose() == 3


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
