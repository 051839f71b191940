"""The replay loop the incident benches share: a scenario's database on an injected clock.

bench.incidents (single-rule scenarios) and bench.service_incidents (every shipped rule)
drive their minutes through `Replay`, as the service would: write, then evaluate just
after each minute finished, with the sensitivity job on its schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import BaselineConfig
from alerts.config import AlertsConfig
from alerts.evaluator import EvaluationOptions, evaluate
from alerts.policy import Policy
from alerts.rules import Rule
from alerts.settings import AlertSettings
from alerts.webhooks import WebhookTarget
from monitor.alerting import load_alerts
from monitor.jobs import evaluation_settle, refresh_sensitivity
from monitor.settings import get_settings
from storage.db import make_engine, make_sessionmaker

T0 = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday, 00:00
STALE_AFTER_S = 900.0
# The sensitivity job's schedule in evaluated minutes (alerts.sensitivity_interval_s).
SENSITIVITY_INTERVAL_MIN = max(1, round(AlertSettings().sensitivity_interval_s / 60))


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


class Replay:
    """A scenario's database on an injected clock, driven as the service drives it.

    Minutes are written as the probes would write them; each evaluated minute is judged
    just after it finished (`alerts.evaluator.evaluate`), and the sensitivity job (the
    scheduled job's body, `monitor.jobs.refresh_sensitivity`: the false-page budget's
    widened thresholds) runs every `alerts.sensitivity_interval_s` with its production
    bounds. The history before the first evaluation is the service's past: that
    evaluation chunks all of it (a service evaluating all along has every finished hour
    chunked), and the job then runs until every series is estimated (it would have kept up
    with each baseline refresh). Shared by the single-rule scenarios (`Sim`) and the
    whole-service ones (bench.service_incidents).
    """

    def __init__(self, template: Path, workdir: Path, name: str, rules: Sequence[Rule],
                 policy: Policy | None, target: WebhookTarget,
                 stale_after_s: float | None = STALE_AFTER_S,
                 warmed_at: int | None = None) -> None:
        """warmed_at: the template is a replay's database already evaluated up to this
        minute (its history written, the sensitivity job run); None: a fresh one."""
        path = workdir / f"{name}.db"
        shutil.copy(template, path)
        self.path = path
        self.engine = make_engine(f"sqlite:///{path}")
        self.sm: sessionmaker[Session] = make_sessionmaker(self.engine)
        self.rules, self.policy, self.target = list(rules), policy, target
        self.stale_after_s = stale_after_s
        self.i = warmed_at or 0  # minutes written
        self.config = BaselineConfig(warm_in_s=0)
        self.job_at = warmed_at  # the minute the sensitivity job last ran
        self.jobs: list[object] = []  # what each run of the sensitivity job reported

    def history(self, cycles: int, write: Callable[[Session], None]) -> None:
        """Write `cycles` minutes without evaluating (the time before the replay)."""
        with self.sm.begin() as s:
            for _ in range(cycles):
                write(s)
                self.i += 1

    def evaluate(self) -> None:
        """Evaluate just after minute i - 1 finished; run the sensitivity job when due."""
        first = self.job_at is None
        # The first evaluation chunks every hour of the rules' baseline windows at once:
        # a service evaluating all along has (chunked a few hours at a time, each
        # evaluation's baselines refreshed until done, the job re-estimating them all).
        hours = max(round(r.baseline_window_s / 3600) for r in self.rules) + 2
        config = dataclasses.replace(self.config, backfill_hours=max(
            self.config.backfill_hours, hours)) if first else self.config
        with self.sm.begin() as s:
            evaluate(
                s,
                EvaluationOptions(
                    self.rules,
                    targets=[self.target],
                    policy=self.policy,
                    baseline_config=config,
                    stale_after_s=self.stale_after_s,
                    # The shipped grouping and notification timings and the cause's
                    # window, as the service's.
                    incidents=_service_alerts().incidents,
                ),
                minute(self.i) + timedelta(seconds=30),
                settle=_service_settle(),
            )
        if first or self.i - (self.job_at or 0) >= SENSITIVITY_INTERVAL_MIN:
            self.sensitivity(until_done=first)

    def sensitivity(self, *, until_done: bool = False) -> None:
        """Run the sensitivity job now (until_done: again until no series is left)."""
        alerts = dataclasses.replace(_service_alerts(), rules=tuple(self.rules))
        clock = lambda: minute(self.i) + timedelta(seconds=30)  # noqa: E731 - the job's clock
        while True:
            report = refresh_sensitivity(self.sm, alerts, clock)
            self.jobs.append(report)
            if not until_done or not getattr(report, "left", 0):
                break
        self.job_at = self.i

    def step(self, write: Callable[[Session], None], cycles: int = 1) -> None:
        """Write `cycles` minutes, evaluating just after each one finished."""
        for _ in range(cycles):
            with self.sm.begin() as s:
                write(s)
            self.i += 1
            self.evaluate()


@functools.cache
def _service_alerts() -> AlertsConfig:
    """Return the alerts configuration a service with the shipped settings runs with (as
    built at its start-up: monitor.alerting.load_alerts)."""
    return load_alerts(get_settings())


@functools.cache
def _service_settle() -> dict[str, float]:
    """Return the settle waits the shipped service's evaluation job judges cycles with."""
    return evaluation_settle(get_settings())
