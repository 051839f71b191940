"""bench.incidents --service: one host-wide slowdown over every shipped rule is one page.

Runs one of the bench's scenarios (a 2x slowdown for 6 minutes on every arm, bucket and
the real traffic) through the production evaluator, policy, grouping and outbox.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.incidents import NOISE_FILE, BlockNoise
from bench.service_incidents import ServiceSim, scenarios, summary
from storage import migrate

pytestmark = pytest.mark.slow


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
