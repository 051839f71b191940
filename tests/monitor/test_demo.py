"""`tailwatch demo --fast` end to end: every scripted step must behave as scripted.

Real service (uvicorn on loopback), SQLite, the built-in models, a loopback webhook
receiver and the accelerated schedules. Takes minutes: the traffic-shift step needs two
whole minutes of shifted traffic (traffic is stored in minute rollups), and the canary
waits last as many probe cycles as the rules need at the measured cycle time (a slow
machine waits longer rather than failing).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from rich.console import Console

from monitor.demo.engine import models_present
from monitor.demo.profile import FAST, DemoProfile, demo_policy, demo_rules

if TYPE_CHECKING:
    from monitor.demo.context import StepContext

STEP_NAMES = ("warm-up and baseline", "latency regression", "int8 quality in one bucket",
              "shape churn", "operator override", "traffic shift in one bucket", "weekly report")


def test_demo_modules_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, monitor.demo, monitor.cli.demo\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"torch pulled in: {out.stdout[:300]}"


def test_demo_rule_and_policy_overrides_are_valid(tmp_path: Path):
    import yaml

    from alerts.policy import load_policy
    from alerts.rule_file import load_rules

    rules_file, policy_file = tmp_path / "r.yaml", tmp_path / "p.yaml"
    rules_file.write_text(yaml.safe_dump(demo_rules(FAST)))
    policy_file.write_text(yaml.safe_dump(demo_policy()))
    rules = {r.name: r for r in load_rules(str(rules_file))}
    assert rules["canary_latency_regression"].window_s == FAST.window_s
    assert rules["acceptance_drop"].window_s == 60.0  # traffic rollups are per minute
    quality = rules["output_agreement_drop"]
    assert (quality.window_s, quality.floor, dict(quality.match)) == (
        FAST.window_s, 0.99, {"variant": "optimized"})
    policy = load_policy(str(policy_file))
    assert policy.revert_on == ()
    # The quality step relies on the shipped float32 fallback (not replaced by the demo's).
    fallback = {p.name: p for p in policy.policies}["float32_on_agreement_drop"]
    assert (fallback.flag, fallback.scope_from, fallback.value) == ("quantized", "bucket", False)
    with pytest.raises(ValueError, match="shift_bucket"):
        DemoProfile(name="bad", buckets=(16, 64), canaries_per_bucket=1, probe_interval_s=2,
                    window_s=4, min_baseline_cycles=3, delay_s=0.5, traffic_rate_per_s=4)
    with pytest.raises(ValueError, match="int8_bucket"):
        DemoProfile(name="bad", buckets=(16, 32), canaries_per_bucket=1, probe_interval_s=2,
                    window_s=4, min_baseline_cycles=3, delay_s=0.5, traffic_rate_per_s=4)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not models_present(), reason="built-in models (engine/builtin) missing")
def test_fast_demo_passes_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from monitor.cli import main
    from monitor.demo import DemoOptions, run_demo

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # ./var/compile-cache is reused
    with (tmp_path / "narration.txt").open("w") as narration:
        outcome = run_demo(DemoOptions(profile=FAST, keep_dir=tmp_path / "demo"),
                           Console(file=narration, width=120))

    failed = [f"{s.number} {s.name}: {s.error}" for s in outcome.steps if not s.passed]
    assert not failed, "\n".join(failed)
    assert tuple(s.name for s in outcome.steps) == STEP_NAMES
    assert outcome.exit_code == 0
    fired = {(a["rule"], a["labels"].get("bucket")) for a in outcome.alerts if a["fired_at"]}
    assert ("acceptance_drop", "32") in fired
    assert not {b for r, b in fired if r == "acceptance_drop"} - {"32"}
    assert {("canary_latency_regression", b) for b in FAST.labels} <= fired
    assert any(r == "recompiles_per_hour" for r, _ in fired)
    # The faulty int8 build: agreement fell below the floor in its bucket only, and the
    # policy served that bucket float32 again (the alert then resolved).
    int8 = str(FAST.int8_bucket)
    quality = [a for a in outcome.alerts if a["rule"] == "output_agreement_drop" and a["fired_at"]]
    assert [a["labels"].get("bucket") for a in quality] == [int8]
    assert quality[0]["state"] == "resolved"
    changes = {(c["name"], c["scope"], c["source"], c["actor"]) for c in outcome.flag_changes}
    assert ("quantized", int8, "auto", "policy") in changes
    assert not {s for n, s, _, _ in changes if n == "quantized"} - {int8}
    step = next(s for s in outcome.steps if s.name == "int8 quality in one bucket")
    assert f"quantized[{int8}]=false" in step.headline
    # The narrated agreement is the alert's value when it fired (it reads 1.0 once resolved).
    fired_at = re.search(r"agreement (\d\.\d+)", step.headline)
    assert fired_at is not None and float(fired_at.group(1)) < 0.99, step.headline
    assert ("speculative", "32", "auto", "policy") in changes
    assert ("compiled", "global", "auto", "policy") in changes
    assert ("compiled", "global", "manual", "oncall-alice") in changes
    assert outcome.report_path is not None and outcome.report_path.is_file()
    assert (tmp_path / "demo" / "webhooks.jsonl").stat().st_size > 0
    # The analysis ran in a worker child, as under `serve`, not beside the engine.
    assert "tailwatch worker: running" in (tmp_path / "demo" / "worker.log").read_text()
    # The CLI maps a bad option to one line and a non-zero exit code.
    (tmp_path / "file").write_text("")
    assert main(["demo", "--fast", "--keep", str(tmp_path / "file")]) != 0


class _SlowCycles:
    """A demo API whose canary cycles finish every `period_s` (a loaded machine)."""

    def __init__(self, period_s: float) -> None:
        import time

        self.t0 = time.time()
        self.period_s = period_s

    def probe_cycles(self, limit: int = 50) -> list[dict[str, str]]:
        import time
        from datetime import UTC, datetime

        def iso(t: float) -> str:
            return datetime.fromtimestamp(t, UTC).isoformat()

        n = int((time.time() - self.t0) / self.period_s)
        return [{"started_at": iso(self.t0 + (i - 1) * self.period_s),
                 "finished_at": iso(self.t0 + i * self.period_s)} for i in range(n, 0, -1)]


def _context(api: object) -> StepContext:
    import io

    from monitor.demo.context import StepContext
    from monitor.demo.narration import Narrator

    say = Narrator(Console(file=io.StringIO()), steps=1)
    return StepContext(profile=FAST, api=api, traffic=None, receiver=None,  # type: ignore[arg-type]
                       engine=lambda: None, say=say, run_report=lambda: ("", ""))


def test_a_paced_wait_lasts_its_cycles_on_a_slow_machine() -> None:
    import time

    ctx = _context(_SlowCycles(period_s=0.4))
    start = time.monotonic()
    # Holds after ~1.5 s: a plain 0.2 s timeout would fail, 4 slow cycles (1.6 s) do not.
    seen = ctx.wait_cycles("condition", "true", lambda: (time.monotonic() - start > 1.5,
                                                         "not yet"), cycles=4, min_s=0.2)
    assert seen == "not yet"


def test_a_paced_wait_fails_once_its_cycles_have_passed() -> None:
    import time

    from monitor.demo.errors import CheckFailed

    api = _SlowCycles(period_s=0.3)
    ctx = _context(api)
    since = time.time()
    with pytest.raises(CheckFailed):
        ctx.wait_cycles("condition", "true", lambda: (False, "never"), cycles=3, min_s=0.1)
    finished, period = ctx.cycle_stats(since)
    assert finished >= 3
    assert period == pytest.approx(0.3)


class _Measured:
    """A demo API with canary p50 baselines and canary cycles that took `took_s` each."""

    def __init__(self, values: dict[str, float], took_s: float) -> None:
        self.values = values
        self.took_s = took_s

    def baselines(self, metric: str) -> list[dict[str, object]]:
        return [{"value": v, "scope": {"bucket": b, "window": f"{FAST.window_s:g}s",
                                       "source": "canary"}} for b, v in self.values.items()]

    def probe_cycles(self, limit: int = 50) -> list[dict[str, str]]:
        from datetime import UTC, datetime, timedelta

        start = datetime(2026, 12, 1, tzinfo=UTC)
        return [{"started_at": start.isoformat(),
                 "finished_at": (start + timedelta(seconds=self.took_s)).isoformat()}]


def test_the_injected_delay_clears_the_band_and_fits_a_rule_cycle() -> None:
    from monitor.demo.errors import CheckFailed
    from monitor.demo.steps import regression_delay

    calls = (len(FAST.buckets) + 1) * FAST.canaries_per_bucket  # and past the largest
    fast = _context(_Measured({"16": 0.05, "32": 0.08, "64": 0.1}, took_s=1))
    assert regression_delay(fast) == FAST.delay_s  # 0.8 s is 8x the slowest baseline
    # 3x the slowest bucket's baseline (overflow is no bucket of the rule's check).
    slower = _context(_Measured({"16": 0.2, "32": 0.3, "64": 0.1, "overflow": 5.0}, took_s=1))
    assert regression_delay(slower) == pytest.approx(3 * 0.3)
    # The profile's 0.8 s would stretch a 5 s probe cycle past the rule cycle: less, still
    # past the band.
    tight = _context(_Measured({"16": 0.1, "32": 0.15, "64": 0.1}, took_s=5))
    room = (FAST.window_s - 5) / calls
    assert 3 * 0.15 < room < FAST.delay_s
    assert regression_delay(tight) == pytest.approx(room)
    assert not any("outlasts" in e for e in tight.events)
    # The band's delay outlasts one rule cycle but not two: injected, and said.
    long = _context(_Measured({"16": 0.6, "32": 0.3, "64": 0.3}, took_s=2))
    assert regression_delay(long) == pytest.approx(3 * 0.6)
    assert "outlasts" in long.events[-1]
    # Past two rule cycles no slowed cycle is ever judged: say so, with the numbers.
    loaded = _context(_Measured({"16": 0.8, "32": 0.92, "64": 0.69}, took_s=6))
    with pytest.raises(CheckFailed, match="too slow"):
        regression_delay(loaded)


def test_a_wait_with_progress_lasts_while_it_moves_and_fails_once_stuck() -> None:
    import time

    from monitor.demo.errors import CheckFailed

    ctx = _context(None)
    start = time.monotonic()

    def moving() -> tuple[bool, str]:
        step = int((time.monotonic() - start) / 0.5)
        return step >= 4, f"{step}/4 buckets warm"

    # 2 s in all, never 1 s without progress: a plain 1 s timeout would have failed.
    assert ctx.wait_progress("warm", "4/4", moving, stall_s=1.0) == "4/4 buckets warm"
    began = time.monotonic()
    with pytest.raises(CheckFailed):
        ctx.wait_progress("warm", "4/4", lambda: (False, "1/4 buckets warm"), stall_s=1.0)
    assert time.monotonic() - began < 5


def test_the_int8_rollout_serves_int8_only_where_rolled_out_and_stored_flags_win() -> None:
    from engine.protocol import InMemoryFlagProvider, RuntimeFlags
    from monitor.demo.engine import Int8Rollout

    stored = InMemoryFlagProvider(RuntimeFlags())  # quantized_default True: int8 everywhere
    rollout = Int8Rollout(stored)
    assert not any(rollout.flags().quantized_for(b) for b in ("16", "32", "64", "overflow"))
    rollout.roll_out("64")
    flags = rollout.flags()
    assert [b for b in ("16", "32", "64", "overflow") if flags.quantized_for(b)] == ["64"]
    # The policy's fallback (a stored per-bucket row) turns it off again there.
    rollout.inner = InMemoryFlagProvider(RuntimeFlags(quantized={"64": False}))
    assert not rollout.flags().quantized_for("64")


def test_the_demo_worker_reads_back_the_demo_settings(tmp_path: Path) -> None:
    """The config file the demo's worker child starts from holds the demo's settings, secrets too."""
    from monitor.demo.profile import demo_settings
    from monitor.demo.server import write_config
    from monitor.settings import get_settings

    settings = demo_settings(FAST, tmp_path, receiver_url="http://127.0.0.1:9/hook",
                             report_dir=tmp_path / "reports", token="s" * 24)
    (tmp_path / "demo-config.yaml").write_text("an earlier run's")
    (tmp_path / "demo-config.yaml").chmod(0o644)
    path = write_config(settings, tmp_path / "demo-config.yaml")
    assert path.stat().st_mode & 0o077 == 0  # it holds the operator's token
    assert get_settings(str(path)) == settings
    # Not the shipped nice 10: a niced worker holds SQLite's write lock for long on a
    # saturated host, and the shifted traffic's rows (the acceptance alert) come late.
    assert get_settings(str(path)).worker.nice == 0


def test_the_report_step_measures_speedups_with_ab_cycles(tmp_path: Path) -> None:
    """The demo's service (fake engine) answers the report step's A/B cycles: speedups shown."""
    import io

    from monitor.app import create_app
    from monitor.demo.client import ServiceClient
    from monitor.demo.context import StepContext
    from monitor.demo.engine import DemoEngineFactory
    from monitor.demo.narration import Narrator
    from monitor.demo.profile import demo_settings
    from monitor.demo.scenario import report_runner
    from monitor.demo.server import ServiceThread
    from monitor.demo.steps import (
        NOTHING_MEASURED,
        SPEEDUP_SECTION,
        ab_cycles,
        report_section,
        weekly_report,
    )
    from monitor.demo.traffic import TrafficGenerator
    from monitor.loopback import WebhookReceiver

    with WebhookReceiver() as receiver:
        settings = demo_settings(FAST, tmp_path, receiver_url=receiver.url,
                                 report_dir=tmp_path / "reports", token="t" * 24)
        assert settings.probes.ab_share == 0.0  # scheduled cycles stay arm-free
        app = create_app(settings, engine_factory=DemoEngineFactory(fake=True),
                         analysis_in_process=False)
        written: list[Path] = []
        with ServiceThread(app) as service:
            api = ServiceClient(service.url, token="t" * 24)
            ctx = StepContext(profile=FAST, api=api,
                              traffic=TrafficGenerator(service.url, rate_per_s=1.0),
                              receiver=receiver, engine=lambda: None,
                              say=Narrator(Console(file=io.StringIO()), steps=1),
                              run_report=report_runner(app, settings, written))
            ctx.wait_for("ready", "GET /readyz 200", lambda: (api.readyz()[0] == 200, ""), 60)
            weekly_report(ctx)
            speedups = api.speedups()
            api.close()

    assert ab_cycles(FAST) * FAST.canaries_per_bucket >= 6  # a 95% CI per bucket
    assert {s["optimization"] for s in speedups} >= {"compile", "speculative"}
    assert all(s["pairs"] >= 6 for s in speedups if s["bucket"] != "all")
    report = written[0].read_text()
    section = report_section(report, SPEEDUP_SECTION)
    assert NOTHING_MEASURED not in section
    for arm in ("eager", "direct"):
        assert f"| {arm} |" in section
    assert f"_{NOTHING_MEASURED}" not in report_section(
        report, "Optimizations that cost more than they earn")


def test_a_kept_directory_starts_without_an_earlier_runs_state(tmp_path: Path) -> None:
    """--keep DIR: an earlier demo's database and logs go, anything else stays."""
    from monitor.demo.scenario import DB_NAME, DemoOptions, _workdir

    earlier = [DB_NAME, f"{DB_NAME}-wal", "webhooks.jsonl", "demo.log", "worker.log"]
    for name in [*earlier, "notes.txt"]:
        (tmp_path / name).write_text("earlier run")
    assert _workdir(DemoOptions(keep_dir=tmp_path)) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


class _ShiftAlerts:
    """A demo API whose acceptance_drop for bucket 32 goes pending at once and fires at
    `fires_after_s`; as traffic, no samples."""

    def __init__(self, fires_after_s: float) -> None:
        import time

        self.t0, self.fires_after_s = time.monotonic(), fires_after_s
        self.polls: list[str] = []

    def alerts(self, state: str = "open", *_args: object) -> list[dict[str, object]]:
        import time

        fired = time.monotonic() - self.t0 >= self.fires_after_s
        now = "firing" if fired else "pending"
        self.polls.append(now)
        alert = {"id": 7, "rule": "acceptance_drop", "state": now, "labels": {"bucket": "32"},
                 "started_at": "2026-12-05T07:32:06Z", "updated_at": "2026-12-05T07:36:06Z",
                 "annotations": {"summary": "acceptance -40%", "description": (
                     "acceptance_rate 0.04 breaches (-94.7%) but is not confirmed yet "
                     "(CUSUM 10.0 of 14, 2 cycles needed)")}}
        return [alert] if state == "open" or state == now else []

    def samples(self, **_filters: object) -> list[object]:
        return []


def test_the_shift_wait_lasts_the_rules_for_cycles_once_the_alert_is_pending() -> None:
    from dataclasses import replace

    from monitor.demo.errors import CheckFailed
    from monitor.demo.steps import _acceptance_alert
    from monitor.demo.traffic import Lane

    lane = Lane("shifted/32", "shifted", 17, 31, weight=1.0)
    # A loaded worker fires the pending alert after the plain timeout: still no stuck rule.
    fake = _ShiftAlerts(fires_after_s=1.5)
    ctx = _context(fake)
    ctx.profile = replace(FAST, shift_bucket=32, shift_timeout_s=0.5, shift_pending_s=3.0)
    ctx.traffic = fake  # type: ignore[assignment]
    ctx.receiver = _Receiver()  # type: ignore[assignment]
    ctx.memo["acceptance_before"] = set()
    assert _acceptance_alert(ctx, lane, 0.0)["id"] == 7
    assert fake.polls[0] == "pending" and "firing" in fake.polls
    # Pending past shift_pending_s too: the rule is stuck, and the wait says so.
    stuck = _context(_ShiftAlerts(fires_after_s=60.0))
    stuck.profile = replace(FAST, shift_bucket=32, shift_timeout_s=0.2, shift_pending_s=0.6)
    stuck.traffic = fake  # type: ignore[assignment]
    stuck.memo["acceptance_before"] = set()
    # The failure says why the rule held back, as the worker last judged it.
    with pytest.raises(CheckFailed, match=r"last judged 2026-12-05T07:36:06Z: .*CUSUM 10.0 of 14"):
        _acceptance_alert(stuck, lane, 0.0)


def test_the_shift_starts_at_a_minutes_start() -> None:
    from monitor.demo.steps import MINUTE_MARGIN_S, until_next_minute

    # Traffic rollups are per minute: a shift at 07:30:31 would leave 07:30 half shifted.
    at = 1_796_455_831.0  # 07:30:31 UTC
    assert (at + until_next_minute(at)) % 60 == pytest.approx(MINUTE_MARGIN_S)
    assert until_next_minute(at) == pytest.approx(29 + MINUTE_MARGIN_S)
    assert until_next_minute(at - 31) == pytest.approx(60 + MINUTE_MARGIN_S)  # 07:30:00 sharp


class _Receiver:
    """A webhook receiver that got bucket 32's firing acceptance_drop."""

    def alerts(self, rule: str, status: str) -> list[tuple[object, dict[str, object]]]:
        return [(None, {"labels": {"bucket": "32"}})]

    def deliveries(self) -> list[object]:
        return [object()]
