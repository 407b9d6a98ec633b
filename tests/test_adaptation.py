"""The adaptive threshold: one rule, shared by the drafters and the search's replay of decoding."""

import pytest

from selfspec.drafters.adaptation import AdaptiveThreshold


def test_rises_while_acceptance_is_below_target_and_falls_above():
    t = AdaptiveThreshold(0.5, adaptive=True, target=0.8)
    t.update(4, 0)  # running acceptance 0.8 -> 0.56: below target
    assert t.value == pytest.approx(0.55) and t.acceptance == pytest.approx(0.56)
    for _ in range(20):
        t.update(4, 4)  # every draft accepted: the running acceptance climbs past the target
    assert t.acceptance > 0.8 and t.value < 0.55


def test_bounded_and_inert_when_off_or_nothing_drafted():
    t = AdaptiveThreshold(0.9, adaptive=True)
    for _ in range(10):
        t.update(3, 0)
    assert t.value == pytest.approx(0.95)  # the ceiling
    low = AdaptiveThreshold(0.02, adaptive=True)
    for _ in range(10):
        low.update(2, 2)
    assert low.value == 0.0
    fixed = AdaptiveThreshold(0.4, adaptive=False)
    fixed.update(5, 0)
    assert fixed.value == 0.4
    idle = AdaptiveThreshold(0.4)
    idle.update(0, 0)
    assert (idle.value, idle.acceptance) == (0.4, 0.8)
