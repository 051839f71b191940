"""Start-up's alerts config: the first page waits for its cause only where arms can run."""

from __future__ import annotations

import pytest

from monitor.alerting import load_alerts
from monitor.settings import get_settings
from probes.settings import ProbeSettings


@pytest.mark.parametrize(("probes", "wait"), [
    (ProbeSettings(), 120.0),  # a quarter of cycles drawn, and after a slow one
    (ProbeSettings(ab_on_slowdown=None), 120.0),  # drawn only
    (ProbeSettings(ab_share=0.0), 0.0),  # on demand needs drawn arms to compare with
    (ProbeSettings(ab_share=0.0, ab_on_slowdown=None), 0.0),
    (ProbeSettings(ab_arms=()), 0.0),
])
def test_cause_wait_is_off_when_no_cycle_runs_arms(probes: ProbeSettings, wait: float):
    settings = get_settings(probes=probes)
    assert load_alerts(settings).incidents.cause_wait_s == wait


def test_cause_wait_set_to_zero_stays_zero():
    settings = get_settings(alerts={"incidents": {"cause_wait_s": 0}})
    assert load_alerts(settings).incidents.cause_wait_s == 0.0
