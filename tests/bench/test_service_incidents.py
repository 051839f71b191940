"""bench.incidents --service: one host-wide slowdown over every shipped rule is one page.

Runs one of the bench's scenarios (a 2x slowdown for 6 minutes on every arm, bucket and
the real traffic) through the production evaluator, policy, grouping and outbox: one
firing and one resolved notification, the resolved one soon after the slowdown ended
(before, per-cycle hysteresis on noisy medians and pooled p99s still holding the
slowdown's samples kept the incident open for the rest of the scenario).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.incidents import NOISE_FILE, BlockNoise
from bench.service_incidents import ServiceSim, scenarios, summary
from storage import migrate

pytestmark = pytest.mark.slow
# The most cycles a recovering series' median is read over (the shipped rules' lookback).
RESOLVED_WITHIN_MIN = 30


def test_a_host_wide_slowdown_pages_once_with_host_or_load(tmp_path: Path) -> None:
    template = tmp_path / "template.db"
    migrate.upgrade(f"sqlite:///{template}")
    noise = BlockNoise(json.loads(NOISE_FILE.read_text()), cv=0.10)
    name, worlds, start, expected = scenarios(quick=True)[0]
    assert expected == "host_or_load"
    sim = ServiceSim(template, tmp_path, "host", noise.stream, seed=1)
    first = sim.run(worlds, history=240)
    window = (first + start, first + start + worlds[1][0])
    outcome = sim.outcome(name, window, expected, first)
    assert len(outcome.pages) == 1, outcome.causes
    assert outcome.cause_right, outcome.causes
    assert outcome.late == 0 and outcome.early == 0, outcome.causes
    assert summary([outcome]).splitlines()[-1].startswith(
        "pages per incident: max 1 (all rules), cause right: 1 of 1")
    # One resolved notification, within the rules' lookback of the slowdown's end: the
    # members' last cycles back (their median, over as many cycles as each series' noise
    # needs; a pooled p99's own samples), not the pool emptying of the slowdown's samples
    # (25 cycles) nor a run of noisy cycles all inside a band narrower than their noise.
    [(incident, times)] = outcome.resolutions().items()
    assert len(times) == 1, (incident, times, outcome.causes)
    after = outcome.resolved_after()
    assert after is not None and 0 < after <= RESOLVED_WITHIN_MIN, after
