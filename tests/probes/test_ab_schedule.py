"""The A/B schedule: drawn on a share of the cycles, and on demand after a slow cycle."""

from __future__ import annotations

import math
import random

import pytest

from probes.ab_schedule import AbSchedule
from vocab import AbReason

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
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, confirm=1)
    rng = Never()
    assert steady(schedule, 10, rng) == [None] * 10
    assert schedule.observe(scaled(1.3), ab=False)  # host-wide +30%: slow
    assert schedule.due(rng) == AbReason.SLOWDOWN
    # Paid off by a cycle that ran them, unless it was slow again (while it persists).
    schedule.observe(STEADY, ab=True)
    assert schedule.due(rng) is None


def test_a_slowdown_that_persists_keeps_the_arms_running() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, confirm=1)
    # Both kinds of cycle in the history: the on-demand A/B cycles are judged against the
    # A/B cycles before the slowdown.
    assert steady(schedule, 60, random.Random(1)).count(AbReason.DRAWN) >= schedule.min_history
    rng = Never()
    reasons = []
    for _ in range(3):
        schedule.observe(scaled(1.5), ab=schedule.due(rng) is not None)
        reasons.append(schedule.due(rng))
    assert reasons == [AbReason.SLOWDOWN] * 3


def test_one_bucket_must_rise_further_than_the_median_over_buckets() -> None:
    series = ("64", "compiled", "speculative")
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    steady(schedule, 10, Never())
    assert not schedule.slow(scaled(1.3, series), ab=False)  # one bucket +30%: its noise
    assert schedule.slow(scaled(1.8, series), ab=False)  # one bucket +80% (over 3 x 15%)


def test_an_owed_cycle_is_not_paid_off_by_a_cycle_that_skipped_the_arms() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, confirm=1)
    rng = Never()
    steady(schedule, 10, rng)
    schedule.observe(scaled(2.0), ab=False)
    assert schedule.due(rng) == AbReason.SLOWDOWN
    schedule.observe(STEADY, ab=False)  # the caller forced no arms
    assert schedule.due(rng) == AbReason.SLOWDOWN


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
    assert set(with_demand) == {AbReason.DRAWN, None}
    assert 0.18 < with_demand.count(AbReason.DRAWN) / 400 < 0.32
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


def mixed(schedule: AbSchedule, cycles: int, rng: random.Random,
          ab_factor: float) -> list[tuple[str | None, bool]]:
    """Run `cycles` cycles whose A/B ones sit `ab_factor` times the plain ones' level;
    return each one's reason and whether it came out slow."""
    out = []
    for _ in range(cycles):
        reason = schedule.due(rng)
        ab = reason is not None
        out.append((reason, schedule.observe(scaled(ab_factor) if ab else STEADY, ab=ab)))
    return out


@pytest.mark.parametrize(("share", "ab_factor"), [(0.25, 1.2), (0.75, 1 / 1.2)])
def test_ab_cycles_at_another_level_than_plain_ones_owe_no_arms(
        share: float, ab_factor: float) -> None:
    # Running the arms back to back puts an A/B cycle's optimized canaries 20% above (or
    # below) a plain cycle's, steadily. Judged against one history of both kinds, the
    # minority kind would come out slow (+20% over the 15%) and owe the arms to the next
    # cycle: the monitor measuring itself. Each kind is judged against its own.
    schedule = AbSchedule(share=share, on_slowdown=0.15)
    cycles = mixed(schedule, 400, random.Random(3), ab_factor)
    assert {ab for ab, _ in cycles} == {AbReason.DRAWN, None}
    assert not any(slow for _, slow in cycles)
    assert schedule.owed == 0


def test_a_slowdown_is_still_seen_by_either_kind_of_cycle() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, confirm=1)
    mixed(schedule, 200, random.Random(4), 1.2)
    # +30% over its own kind's level, whichever kind the slowed cycle is.
    assert schedule.slow(scaled(1.3), ab=False)
    assert schedule.slow(scaled(1.2 * 1.3), ab=True)
    assert not schedule.slow(scaled(1.2), ab=True)  # an A/B cycle at its usual level
    assert schedule.observe(scaled(1.2 * 1.3), ab=True)
    assert schedule.due(Never()) == AbReason.SLOWDOWN


def test_each_kind_needs_its_own_min_history() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, min_history=5, confirm=1)
    steady(schedule, 10, Never())  # plain cycles only: no A/B history yet
    assert not schedule.observe(scaled(3.0), ab=True)  # judges nothing
    assert schedule.observe(scaled(3.0), ab=False)


def test_before_the_ab_history_fills_a_slowdown_brings_the_arms_every_other_cycle() -> None:
    # An A/B cycle with too few A/B cycles before it judges nothing: it pays off the debt,
    # and the plain cycle after it, slow again, owes the arms anew.
    schedule = AbSchedule(share=0.25, on_slowdown=0.15, confirm=1)
    rng = Never()
    steady(schedule, 10, rng)  # plain cycles only
    reasons = []
    for _ in range(4):
        reason = schedule.due(rng)
        schedule.observe(scaled(1.5), ab=reason is not None)
        reasons.append(reason)
    assert reasons == [None, AbReason.SLOWDOWN, None, AbReason.SLOWDOWN]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="ab_on_slowdown"):
        AbSchedule(on_slowdown=-0.1)
    with pytest.raises(ValueError, match="ab_share"):
        AbSchedule(share=1.5)
    with pytest.raises(ValueError, match="noise_factor"):
        AbSchedule(noise_factor=-1.0)
    with pytest.raises(ValueError, match="confirm"):
        AbSchedule(confirm=0)


def noisy(schedule: AbSchedule, cycles: int, rng: random.Random, sigma: float,
          factor: float = 1.0) -> list[bool]:
    """Run `cycles` plain cycles whose medians scatter log-normally by `sigma` around the
    steady level times `factor`, the host's share common to every series; return which
    came out slow."""
    out = []
    for _ in range(cycles):
        host = rng.gauss(0.0, sigma)
        medians = {k: v * factor * math.exp(host + rng.gauss(0.0, sigma / 2))
                   for k, v in STEADY.items()}
        out.append(schedule.observe(medians, ab=False))
    return out


def test_on_a_noisy_host_the_threshold_follows_the_cycles_own_spread() -> None:
    # Cycles scattering by about 15% (a contended host, real traffic preempting the
    # canaries): a fixed 15% calls a large share of the ordinary cycles slow, and each
    # brings the arms' synthetic work on the real traffic.
    fixed = noisy(AbSchedule(share=0.25, on_slowdown=0.15, noise_factor=0.0, confirm=1), 1000,
                  random.Random(11), 0.15)
    scaled_ = noisy(AbSchedule(share=0.25, on_slowdown=0.15), 1000, random.Random(11), 0.15)
    assert sum(fixed) > 150  # about 1 in 5
    assert sum(scaled_) < 30  # under 1 in 30


def test_on_a_noisy_host_a_real_slowdown_still_brings_the_arms() -> None:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = random.Random(12)
    noisy(schedule, 100, rng, 0.15)
    # Host-wide 2.5x: slow once it held for `confirm` (2) cycles.
    assert noisy(schedule, 2, rng, 0.15, factor=2.5) == [False, True]


def test_a_quiet_host_keeps_the_fixed_floor() -> None:
    # Nearly no spread: the floors (15% host-wide, 45% one series) decide, as before.
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    noisy(schedule, 40, random.Random(13), 0.005)
    assert schedule.slow(scaled(1.2), ab=False)
    assert not schedule.slow(scaled(1.1), ab=False)
    series = ("64", "compiled", "speculative")
    assert schedule.slow(scaled(1.6, series), ab=False)
    assert not schedule.slow(scaled(1.3, series), ab=False)


def test_a_noisy_series_must_rise_above_its_own_spread() -> None:
    # One bucket scatters by 25% on its own, the other is steady: +60% in the noisy one is
    # within its ordinary excursions, +60% in the steady one is not.
    quiet, loud = ("16", "compiled", "speculative"), ("64", "compiled", "speculative")
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = random.Random(14)
    for _ in range(20):
        schedule.observe({quiet: STEADY[quiet], loud: STEADY[loud] * math.exp(
            rng.gauss(0.0, 0.25))}, ab=False)
    assert not schedule.slow({quiet: STEADY[quiet], loud: STEADY[loud] * 1.6}, ab=False)
    assert schedule.slow({quiet: STEADY[quiet] * 1.6, loud: STEADY[loud]}, ab=False)


def test_a_rise_for_one_cycle_brings_no_arms_two_in_a_row_do() -> None:
    # A cycle's canaries can rise far in one cycle and be back the next (real requests
    # arriving together, a burst): no arms for that; a rise that holds is a slowdown.
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = Never()
    steady(schedule, 10, rng)
    assert not schedule.observe(scaled(2.0), ab=False)
    assert schedule.due(rng) is None
    assert not schedule.observe(STEADY, ab=False)  # back: the run of rises is broken
    assert not schedule.observe(scaled(2.0), ab=False)
    assert schedule.observe(scaled(2.0), ab=False)  # the second in a row
    assert schedule.due(rng) == AbReason.SLOWDOWN


def test_a_cycle_that_judges_nothing_leaves_the_run_of_rises_alone() -> None:
    # Before the A/B history fills, the on-demand A/B cycle judges nothing: the slowdown
    # still brings the arms every other cycle, from the plain cycles between.
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    rng = Never()
    steady(schedule, 10, rng)  # plain cycles only
    reasons = []
    for _ in range(6):
        reason = schedule.due(rng)
        schedule.observe(scaled(1.5), ab=reason is not None)
        reasons.append(reason)
    assert reasons == [None, None, AbReason.SLOWDOWN, None, AbReason.SLOWDOWN, None]
