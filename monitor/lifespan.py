"""Lifespan wiring: build the Services hub at start-up and tear it down at shutdown.

Start-up order: database (schema checked or migrated) -> storage writer -> flag
snapshot -> alerts config (rules, policy, targets: `alerts.config.load_config`) and
deliverer -> engine (loaded in a background thread so /readyz can report "warming")
-> traffic recorder and prober -> scrape-time collectors -> scheduler. Everything
lands in one frozen `monitor.hub.Services` on `app.state.services`; routes get
its parts through the dependency aliases in `monitor.api.deps`.

Every measurement write (probe runs, bursts, compile events, memory samples, traffic
rollups) goes through the one `storage.writer.Writer`: bounded, retried while the
database is down, drops counted in `writer.stats`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from alerts.flags import FlagSnapshot
from engine.protocol import Engine
from monitor.alerting import load_alerts, make_deliverer
from monitor.database import prepare_database
from monitor.engine_holder import EngineHolder
from monitor.hub import AppParts, Services, parts_of
from monitor.metrics import (
    DatabaseCollector,
    EngineCollector,
    GcCollector,
    ProcessMemoryCollector,
    SamplerCollector,
)
from monitor.probe_runner import ProbeRunner
from monitor.prober import SchedulerActivity, build_prober
from monitor.settings import Settings
from probes.prober import Prober
from probes.sampler import TrafficSampler
from probes.traffic import TrafficRecorder
from storage.db import make_sessionmaker
from storage.writer import Writer
from vocab import utcnow

if TYPE_CHECKING:
    from monitor.scheduler import JobScheduler

log = logging.getLogger(__name__)

Closers = list[Callable[[], object]]  # run last-first at shutdown
SHUTDOWN_WAIT_S = 10.0  # for scheduled runs in flight at shutdown


def make_flag_provider(sessions: sessionmaker[Session], ttl_s: float,
                       instance_id: str | None = None) -> FlagSnapshot:
    """Return the flag snapshot the engine reads on every request (refreshed in background).

    A request never waits on SQL: it reads the snapshot; a thread re-reads the flag
    tables every `ttl_s` (and at once after `invalidate()`).
    """
    # instance_id: an "instance:<id>" scoped flag (a per-instance eager fallback) applies here.
    snapshot = FlagSnapshot(sessions, ttl_s=ttl_s, instance_id=instance_id)
    snapshot.start()
    return snapshot


def _sampler(settings: Settings, writer: Writer, closers: Closers) -> TrafficSampler | None:
    quality = settings.quality
    if not quality.enabled or quality.traffic_sample_share <= 0:
        return None
    sampler = TrafficSampler(writer, share=quality.traffic_sample_share,
                             queue_max=quality.sample_queue_max,
                             instance_id=settings.instance_id, store_text=quality.store_text,
                             timeout_s=settings.probes.cycle_timeout_s)
    closers.append(sampler.close)  # before the writer closes: its rows go through it
    return sampler


def build_services(parts: AppParts, closers: Closers) -> Services:
    """Build every long-lived part of one app; register each closer as it is built."""
    settings, seams = parts.settings, parts.seams
    db = prepare_database(settings)
    closers.append(db.dispose)
    sessions = make_sessionmaker(db)
    writer = Writer(sessions, max_pending=settings.write_buffer_max)
    closers.append(lambda: _close_writer(writer))
    alerts = load_alerts(settings)
    flags = make_flag_provider(sessions, alerts.flags_ttl_s, settings.instance_id)
    closers.append(flags.close)
    deliverer = make_deliverer(sessions, alerts, seams, closers)
    holder = EngineHolder(seams.engine_factory, settings.engine, flags)
    closers.append(holder.close)
    # A clock given to the app (tests, the demo) stamps traffic minutes too; the default
    # stays the recorder's own (time.time: one C call per request).
    traffic = TrafficRecorder(settings.instance_id,
                              buffer_max=settings.probes.rollup_buffer_max,
                              clock=None if seams.clock is utcnow else seams.clock)
    # Runs before the writer closes (closers run last-first): the last rollups.
    closers.append(lambda: traffic.flush(writer))
    sampler = _sampler(settings, writer, closers)

    activity = SchedulerActivity()

    def prober(engine: Engine) -> Prober:
        return build_prober(settings, engine, writer, sessions, observers=(parts.sink,),
                            suites=seams.suites, activity=activity)

    return Services(
        settings=settings, authenticator=parts.authenticator, metrics=parts.metrics,
        sink=parts.sink, seams=seams, db=db, sessions=sessions, flags=flags,
        engine_holder=holder, writer=writer, traffic=traffic,
        probes=ProbeRunner(holder, prober), alerts=alerts, deliverer=deliverer,
        sampler=sampler, analysis_in_process=parts.analysis_in_process,
        activity=activity)


def _collectors(services: Services) -> list[Collector]:
    s, metrics = services, services.metrics
    out: list[Collector] = [
        EngineCollector(metrics, s.engine_holder.get),
        DatabaseCollector(metrics, s.sessions, s.flags, tuple(s.settings.engine.buckets)),
        ProcessMemoryCollector(metrics),
        GcCollector(metrics),
    ]
    if s.sampler is not None:
        live = s.sampler  # narrowed: the closure reads a non-None sampler
        out.append(SamplerCollector(metrics, lambda: live.stats))
    return out


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Build the Services hub, put it on app.state, and close everything at shutdown."""
    parts = parts_of(app)
    closers: Closers = []
    collectors: list[Collector] = []
    scheduler: JobScheduler | None = None
    try:
        services = build_services(parts, closers)
        collectors = _collectors(services)
        services.engine_holder.start()
        if parts.settings.scheduler.enabled:
            scheduler = (parts.seams.scheduler_factory or start_scheduler)(services)
            services = replace(services, scheduler=scheduler)
            services.activity.scheduler = scheduler
        app.state.services = services
        log.info("tailwatch: serving (instance %s, scheduler %s)", parts.settings.instance_id,
                 "on" if scheduler is not None else "off")
        yield
    finally:
        app.state.services = None
        if scheduler is not None:
            with suppress(Exception):
                scheduler.shutdown(wait=False)
                # A run in flight still holds a session: let it end before the database
                # closes under it, but never let a hung probe hold up the shutdown.
                if not scheduler.wait_idle(SHUTDOWN_WAIT_S):
                    log.warning("tailwatch: a scheduled job still runs at shutdown")
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:
                log.warning("tailwatch: shutdown step failed: %s", exc)
        for collector in collectors:
            with suppress(KeyError):
                parts.metrics.registry.unregister(collector)


def _close_writer(writer: Writer) -> None:
    """Write what is queued (best effort: a down database loses only these, counted)."""
    left = writer.close(timeout=5.0)
    stats = writer.stats
    if left or stats.dropped or stats.failed:
        log.warning("storage writer: %d writes left unwritten at shutdown; %d dropped and "
                    "%d failed since start", left, stats.dropped, stats.failed)


def start_scheduler(services: Services) -> JobScheduler:
    """Build and start the serving process's job scheduler (with its job metrics).

    It runs the replica jobs (probe, burst, traffic_flush), and the analysis jobs too
    only when the app was built with `analysis_in_process` (else `tailwatch worker` does).
    """
    from monitor.job_metrics import JobMetrics
    from monitor.jobs import replica_jobs, scheduled_jobs
    from monitor.leader import make_leader
    from monitor.scheduler import build_scheduler

    jobs = scheduled_jobs(services) if services.analysis_in_process else replica_jobs(services)
    scheduler = build_scheduler(services.settings, jobs, make_leader(services.db),
                                metrics=JobMetrics(services.metrics.registry))
    scheduler.start()
    return scheduler
