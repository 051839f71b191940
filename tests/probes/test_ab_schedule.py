"""The A/B schedule: drawn on a share of the cycles, and on demand after a slow cycle."""

from __future__ import annotations

import random

import pytest

from probes.ab_schedule import AB_DRAWN, AB_SLOWDOWN, AbSchedule

STEADY = {("16", "compiled", "speculative"): 0.10, ("64", "compiled", "speculative"): 0.30}


class Never(random.Random):
    """An rng whose draws never fall within the share (only the slowdown brings arms)."""

    def random(self) -> float:
        return 0.999


def steady(schedule: AbSchedule, cycles: int, rng: random.Random) -> list[str | None]:
    """Run `cycles` steady cycles through `schedule`; return each one's reason."""
    out = []
    for _ in range(cycles):
        reason = schedule.due(rng)
        schedule.observe(STEADY, ab=reason is not None)
        out.append(reason)
    return out


def scaled(factor: float, series: tuple[str, str, str] | None = None) -> dict:
    """Return the steady medians times `factor` (in one series, or all)."""
    return {k: v * (factor if series in (None, k) else 1.0) for k, v in STEADY.items()}


def test_after_a_slow_cycle_the_next_one_runs_the_arms_whatever_the_draw() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = Never()
    assert steady(schedule, 10, rng) == [None] * 10
    assert schedule.observe(scaled(1.3), ab=False)  # host-wide +30%: slow
    assert schedule.due(rng) == AB_SLOWDOWN
    # Paid off by a cycle that ran them, unless it was slow again (while it persists).
    schedule.observe(STEADY, ab=True)
    assert schedule.due(rng) is None


def test_a_slowdown_that_persists_keeps_the_arms_running() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = Never()
    steady(schedule, 10, rng)
    reasons = []
    for _ in range(3):
        schedule.observe(scaled(1.5), ab=schedule.due(rng) is not None)
        reasons.append(schedule.due(rng))
    assert reasons == [AB_SLOWDOWN] * 3


def test_one_bucket_must_rise_further_than_the_median_over_buckets() -> None:
    series = ("64", "compiled", "speculative")
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    steady(schedule, 10, Never())
    assert not schedule.slow(scaled(1.3, series))  # one bucket +30%: within its noise
    assert schedule.slow(scaled(1.8, series))  # one bucket +80% (over 3 x 15%)


def test_an_owed_cycle_is_not_paid_off_by_a_cycle_that_skipped_the_arms() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = Never()
    steady(schedule, 10, rng)
    schedule.observe(scaled(2.0), ab=False)
    assert schedule.due(rng) == AB_SLOWDOWN
    schedule.observe(STEADY, ab=False)  # the caller forced no arms
    assert schedule.due(rng) == AB_SLOWDOWN


def test_too_little_history_judges_nothing() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, min_history=5)
    steady(schedule, 4, Never())
    assert not schedule.observe(scaled(3.0), ab=False)
    assert schedule.due(Never()) is None


@pytest.mark.parametrize(("share", "off"), [(0.25, 0.0), (0.25, None), (0.0, 0.15)])
def test_off_when_the_setting_is_zero_or_null_or_no_arm_is_drawn(
        share: float, off: float | None) -> None:
    schedule = AbSchedule(share=share, on_slowdown=off)
    rng = Never()
    steady(schedule, 10, rng)
    assert not schedule.observe(scaled(3.0), ab=False)
    assert schedule.due(rng) is None and schedule.owed == 0


def test_a_steady_series_keeps_the_background_share_and_draws_every_cycle() -> None:
    on, off = random.Random(5), random.Random(5)
    with_demand = steady(AbSchedule(share=0.25, on_slowdown=0.15), 400, on)
    drawn_only = steady(AbSchedule(share=0.25, on_slowdown=None), 400, off)
    assert with_demand == drawn_only  # nothing slow: the draw alone decides
    assert set(with_demand) == {AB_DRAWN, None}
    assert 0.18 < with_demand.count(AB_DRAWN) / 400 < 0.32
    assert on.random() == off.random()  # one draw per cycle on both


def test_a_slowdown_leaves_the_drawn_schedule_alone() -> None:
    # The same draws with and without a slowdown: the draw is taken every cycle, owed or not.
    plain, slowed = AbSchedule(share=0.25), AbSchedule(share=0.25)
    a, b = random.Random(9), random.Random(9)
    steady(plain, 10, a)
    steady(slowed, 10, b)
    slowed.observe(scaled(2.0), ab=False)
    plain.observe(STEADY, ab=False)
    for _ in range(20):
        ra, rb = plain.due(a), slowed.due(b)
        assert ra is None or rb == ra  # every drawn cycle is drawn on both
        plain.observe(STEADY, ab=ra is not None)
        slowed.observe(STEADY, ab=rb is not None)
    assert a.random() == b.random()


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="ab_on_slowdown"):
        AbSchedule(on_slowdown=-0.1)
    with pytest.raises(ValueError, match="ab_share"):
        AbSchedule(share=1.5)
