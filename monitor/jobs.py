"""The scheduled job bodies: what each job name runs, in the serving process or the worker.

Every replica's serving process runs the measurement jobs (probe, burst, traffic_flush:
they need its engine); every process with a scheduler trims its own heap (memory_trim).
The analysis jobs (evaluate, delivery, retention, report, sensitivity) read
only SQL: `tailwatch worker` runs them in a process of its own, so their Python work never
shares the GIL with the engine; an app built with `analysis_in_process` (the demo, tests)
runs them beside the engine as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import FlagProvider
from monitor import scheduler as names
from monitor.hub import Services
from monitor.settings import Settings
from storage.db import reading

if TYPE_CHECKING:
    from alerts.config import AlertsConfig
    from alerts.outbox import Deliverer
    from alerts.sensitivity import DueEstimates, RefreshReport
    from monitor.metrics import MetricsSink

# Seconds past a replica's traffic flush interval before a minute of traffic is judged.
TRAFFIC_SETTLE_MARGIN_S = 5.0

Job = Callable[[], object]


@dataclass(frozen=True)
class AnalysisParts:
    """What the analysis jobs read: settings, SQL, the alerts config and the deliverer."""

    settings: Settings
    sessions: sessionmaker[Session]
    clock: Callable[[], datetime]
    alerts: AlertsConfig
    deliverer: Deliverer
    flags: FlagProvider  # told after an evaluation (the policy may have flipped flags)
    sink: MetricsSink  # delivery outcomes become counters


def analysis_parts(s: Services) -> AnalysisParts:
    """Return the analysis jobs' parts of a running app."""
    return AnalysisParts(settings=s.settings, sessions=s.sessions, clock=s.seams.clock,
                         alerts=s.alerts, deliverer=s.deliverer, flags=s.flags, sink=s.sink)


def replica_jobs(s: Services) -> dict[str, Job]:
    """Return the jobs every replica's serving process runs (they measure its engine)."""
    return {
        names.PROBE: s.probes.job("cycle"),
        names.BURST: s.probes.job("burst"),
        names.TRAFFIC_FLUSH: lambda: _traffic_flush(s),
        **process_jobs(s.seams.trim_heap),
    }


def process_jobs(trim_heap: Job) -> dict[str, Job]:
    """Return the jobs every process with a scheduler runs on itself (serve, worker)."""
    # glibc keeps what a thread frees in its arena, resident, for that arena's later use:
    # the peak of a burst (many requests at once) or of an hour's evaluation stays in
    # the RSS, spread in free chunks between live ones that no heap shrink can reach.
    # malloc_trim hands those chunks' whole pages back, so the RSS follows what is in use.
    return {names.MEMORY_TRIM: trim_heap}


def _traffic_flush(s: Services) -> object:
    """Read the engine's batching loop into this minute, then flush traffic and compiles."""
    engine = s.engine_holder.get()
    if engine is not None:
        s.traffic.sample_batch(engine.batch_snapshot())
    return s.traffic.flush(s.writer), s.probes.record_compiles()


def analysis_jobs(a: AnalysisParts) -> dict[str, Job]:
    """Return the leader-only jobs (evaluation, delivery, retention, the weekly report,
    the rules' sensitivity estimates)."""
    return {
        names.RETENTION: lambda: _prune(a),
        names.EVALUATE: lambda: _evaluate(a),
        names.DELIVERY: lambda: _deliver(a),
        names.REPORT: lambda: _report(a),
        names.SENSITIVITY: lambda: _sensitivity(a),
    }


def scheduled_jobs(services: Services) -> dict[str, Job]:
    """Return every job callable of a running app (the scheduler drops those settings disable)."""
    return {**replica_jobs(services), **analysis_jobs(analysis_parts(services))}


def _prune(s: AnalysisParts) -> object:
    from storage.retention import prune

    with s.sessions.begin() as session:
        return prune(session, s.clock(), s.settings.retention.raw_days,
                     s.settings.retention.rollup_days)


def evaluation_settle(settings: Settings) -> dict[str, float]:
    """Return row kind -> seconds after a cycle's end before the evaluation judges it
    (alerts.series.RowCache.settle)."""
    # Every replica flushes its traffic rollups on its own schedule: a minute is judged
    # once each has flushed it (the interval, plus a margin for the write itself).
    flushed = settings.scheduler.traffic_flush_interval_s + TRAFFIC_SETTLE_MARGIN_S
    return {"traffic": flushed, "batch": flushed}  # batch rollups flush with traffic


def _evaluate(s: AnalysisParts) -> object:
    from alerts.evaluator import evaluate_split
    from monitor.events import log_evaluation

    # Read and scored outside the write transaction: on SQLite the serving process's
    # writes would otherwise queue behind the whole evaluation.
    report = evaluate_split(s.sessions, s.alerts, s.clock(), settle=evaluation_settle(s.settings))
    # The policy may have flipped flags: let the engine see them on its next request.
    s.flags.invalidate()
    log_evaluation(report)  # alert fired/resolved, flags the policy changed
    return report


def _deliver(s: AnalysisParts) -> object:
    report = s.deliverer.run_once()
    s.sink.deliveries(report)
    return report


def _report(s: AnalysisParts) -> object:
    from monitor.report import run_weekly_report

    return run_weekly_report(s.sessions, s.settings)


def _sensitivity(s: AnalysisParts) -> object:
    return refresh_sensitivity(s.sessions, s.alerts, s.clock)


def refresh_sensitivity(sessions: sessionmaker[Session], alerts: AlertsConfig,
                        clock: Callable[[], datetime], *,
                        estimated: Callable[[DueEstimates], None] = lambda due: None,
                        ) -> RefreshReport:
    """Re-estimate the rules' sensitivity (the sensitivity job's body): read and estimate
    in a read-only transaction, then store in a short write transaction.

    On SQLite every write transaction holds the database's one write lock from its BEGIN:
    estimating under it (alerts.sensitivity_job_cpu_s of CPU, far more wall time on a busy
    host) would stop the serving process's traffic and probe writes, and the evaluation's,
    for as long. `estimated` sees the read phase's result inside its transaction (tests).
    """
    from alerts import sensitivity

    now = clock()
    # Bounded by alerts.sensitivity_job_cpu_s; series left over wait for the next run.
    with reading(sessions) as session:
        due = sensitivity.estimate_due(session, alerts.rules, alerts.sensitivity, now,
                                       history_s=alerts.sensitivity_history_s,
                                       budget_s=alerts.sensitivity_job_cpu_s)
        estimated(due)  # still in the read transaction
    with sessions.begin() as session:
        return sensitivity.store_estimates(session, due, now)
