"""Start-up's alerts config: the first page waits for its cause only where arms can run,
and the cause's window reads the rules as the evaluation judges them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from alerts.cause import CauseConfig
from monitor.alerting import load_alerts
from monitor.jobs import TRAFFIC_SETTLE_MARGIN_S, evaluation_settle
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


def test_the_cause_window_reads_the_rules_as_the_evaluation_judges_them(
        caplog: pytest.LogCaptureFixture):
    settings = get_settings()
    with caplog.at_level(logging.INFO, logger="monitor.alerting"):
        alerts = load_alerts(settings)
    cause = alerts.incidents.cause
    # The rules and settle of the evaluation job: the window opens at the start of the
    # rule cycle that breached (alerts.cause.window_start).
    assert cause.rules == alerts.rules
    assert cause.settle == evaluation_settle(settings)
    flushed = settings.scheduler.traffic_flush_interval_s + TRAFFIC_SETTLE_MARGIN_S
    assert cause.settle == {"traffic": flushed, "batch": flushed}
    # The fallback, for a member of a rule not configured: a shipped rule cycle is a
    # minute, a traffic minute judged once every replica's flush and its margin have
    # passed, then up to an evaluation interval; the burst's quarter hour and the sliding
    # hours of memory and compiles do not count.
    assert cause.lead_s == 60 + flushed + settings.scheduler.evaluate_interval_s == 140.0
    assert cause.gap_s == CauseConfig().gap_s  # the baseline hour still ends before it
    assert [r.getMessage() for r in caplog.records if "cause window" in r.getMessage()] == [
        "alerts: an incident's cause window opens at the start of the rule cycle that "
        "breached (the rules' cycles judged as the evaluation does, settled: batch 20 s, "
        "traffic 20 s); 140 s before it went pending for a member of a rule not configured"]


def test_the_fallback_follows_a_longer_rule_cycle(tmp_path: Path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: p99_latency_regression\n    metric: p99_latency\n"
                     "    change: \"+15%\"\n    window: 5m\n")
    settings = get_settings(alerts={"rules_file": str(rules)},
                            scheduler={"evaluate_interval_s": 30})
    assert load_alerts(settings).incidents.cause.lead_s == 300 + 30
