"""The analysis process: evaluation, delivery, retention and the weekly report.

These jobs read and write only SQL. Beside the engine they would share its GIL and
slow the requests they measure, more as history grows; so they run in a process of
their own (`tailwatch worker`), each singleton under a leader lock (a PostgreSQL
advisory lock, or on SQLite a lock file beside the database: one worker of many runs
each singleton). The
worker never loads the engine or torch. Policy actions (flag flips) are SQL writes: each
serving process's flag snapshot picks them up within `alerts.flags_ttl_s`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import httpx
from prometheus_client import CollectorRegistry
from sqlalchemy import Engine as DbEngine

from engine import malloc
from engine.protocol import InMemoryFlagProvider
from monitor.alerting import load_alerts, make_deliverer
from monitor.auth import Authenticator
from monitor.database import prepare_database
from monitor.health_server import HealthServer
from monitor.hub import Seams
from monitor.job_metrics import JobMetrics
from monitor.jobs import AnalysisParts, analysis_jobs, process_jobs
from monitor.leader import LeaderLock, make_leader
from monitor.metrics import GcCollector, Metrics, MetricsSink, ProcessMemoryCollector
from monitor.scheduler import JobScheduler, build_scheduler, job_table
from monitor.settings import Settings
from storage.db import make_sessionmaker
from vocab import utcnow

log = logging.getLogger(__name__)


class WorkerPortError(ValueError):
    """The worker's /healthz and /metrics port cannot be bound."""


@dataclass(frozen=True)
class WorkerSeams:
    """What tests may replace in a worker; production runs the defaults."""

    clock: Callable[[], datetime] = utcnow
    transport: httpx.BaseTransport | None = None  # webhook deliveries
    leader: Callable[[DbEngine], LeaderLock] = make_leader
    trim_heap: Callable[[], object] = malloc.trim  # the memory_trim job's call


class AnalysisWorker:
    """Run the analysis jobs on a scheduler and answer /healthz and /metrics.

    Example:
        worker = AnalysisWorker(settings)
        worker.start()          # raises one-line errors (schema, rules, port)
        worker.port             # where /healthz and /metrics answer
        worker.close()
    """

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 seams: WorkerSeams | None = None, port: int | None = None) -> None:
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.seams = seams or WorkerSeams()
        self._port = settings.worker.port if port is None else port
        self._closers: list[Callable[[], object]] = []
        self.scheduler: JobScheduler | None = None
        self._http: HealthServer | None = None

    def start(self, stop: threading.Event | None = None) -> None:
        """Prepare the database, start the jobs, then serve /healthz and /metrics.

        A locked SQLite database is waited for until it frees or `stop` is set.
        """
        try:
            self._start(stop)
        except BaseException:
            self.close()
            raise

    def _start(self, stop: threading.Event | None) -> None:
        settings = self.settings
        authenticator = Authenticator.from_settings(settings)
        db = prepare_database(settings, stop=stop)
        self._closers.append(db.dispose)
        sessions = make_sessionmaker(db)
        alerts = load_alerts(settings)
        metrics = Metrics(self.registry)
        sink = MetricsSink(metrics)  # webhook delivery counters
        ProcessMemoryCollector(metrics)  # what the worker's RSS holds
        GcCollector(metrics)  # its heap is not frozen: its jobs' pauses stall no request
        deliverer = make_deliverer(sessions, alerts, Seams(clock=self.seams.clock,
                                                           transport=self.seams.transport),
                                   self._closers)
        # No engine here: the serving processes' flag snapshots read policy flips from SQL.
        analysis = AnalysisParts(settings=settings, sessions=sessions, clock=self.seams.clock,
                                 alerts=alerts, deliverer=deliverer,
                                 flags=InMemoryFlagProvider(), sink=sink)
        try:
            self._http = HealthServer(settings.worker.host, self._port, self.registry,
                                      self.health, authenticator)
        except OSError as exc:
            raise WorkerPortError(f"worker.port: cannot listen on {settings.worker.host}:"
                                  f"{self._port}: {exc.strerror or exc}") from exc
        jobs = {**analysis_jobs(analysis), **process_jobs(self.seams.trim_heap)}
        self.scheduler = build_scheduler(settings, jobs,
                                         self.seams.leader(db), clock=self.seams.clock,
                                         metrics=JobMetrics(self.registry))
        self.scheduler.start()
        self._http.start()
        log.info("tailwatch worker: running %s (pid %d); /healthz and /metrics on %s:%d",
                 ", ".join(sorted(self.scheduler.jobs())), os.getpid(),
                 settings.worker.host, self.port)

    @property
    def port(self) -> int:
        """Return the port /healthz and /metrics answer on."""
        return self._http.port if self._http is not None else self._port

    def health(self) -> dict[str, object]:
        """Return the worker's state: pid and the job table."""
        scheduler = self.scheduler
        running = scheduler is not None and scheduler.aps.running
        return {"status": "ok" if running else "stopped", "pid": os.getpid(),
                "jobs": job_table(scheduler.stats()) if scheduler is not None else []}

    def close(self) -> None:
        """Stop the jobs (waiting for a running one), the HTTP server and the database."""
        if self.scheduler is not None:
            try:
                self.scheduler.shutdown(wait=True)
            except Exception as exc:
                log.warning("tailwatch worker: scheduler shutdown failed: %s", exc)
        if self._http is not None:
            self._http.close()
            self._http = None
        for close in reversed(self._closers):
            try:
                close()
            except Exception as exc:
                log.warning("tailwatch worker: shutdown step failed: %s", exc)
        self._closers.clear()
