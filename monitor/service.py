"""Lifespan wiring: build the Services hub at start-up and tear it down at shutdown.

Start-up order: database (schema checked or migrated) -> storage writer -> flag
provider -> alerts config (rules, policy, targets: `alerts.config.load_config`) and
deliverer -> engine (loaded in a background thread so /readyz can report "warming")
-> traffic recorder and prober -> scrape-time collectors -> scheduler. Everything
lands in one frozen `monitor.services.Services` on `app.state.services`; routes get
its parts through the dependency aliases in `monitor.api.deps`.

Every measurement write (probe runs, bursts, compile events, memory samples, traffic
rollups) goes through the one `storage.writer.Writer`: bounded, retried while the
database is down, drops counted in `writer.stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client.registry import Collector
from sqlalchemy import Engine as DbEngine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from engine.config import EngineConfig
from engine.errors import NotReady
from engine.protocol import Engine, FlagProvider
from monitor.metrics import DatabaseCollector, EngineCollector, SamplerCollector
from monitor.secrets import mask_url
from monitor.services import (
    EngineFactory,
    Services,
    default_engine_factory,
    parts_of,
)
from monitor.settings import Settings
from probes.burst import BurstResult
from probes.canaries import load_suites
from probes.cycle import CycleResult
from probes.prober import Prober, prober_from_settings
from probes.reference import OutputChecker
from probes.sampler import TrafficSampler
from probes.traffic import TrafficRecorder
from storage.db import make_engine, make_sessionmaker
from storage.errors import DatabaseUnavailable
from storage.migrate import check_schema, upgrade
from storage.writer import Writer

if TYPE_CHECKING:
    from monitor.scheduler import JobScheduler

log = logging.getLogger(__name__)

__all__ = ["FAILED", "LOADING", "READY", "WARMING", "EngineFactory", "EngineHolder",
           "ProbeRunner", "default_engine_factory", "lifespan", "one_line", "preflight",
           "prepare_database", "scheduled_jobs", "start_scheduler"]

LOADING = "loading"
WARMING = "warming"
READY = "ready"
FAILED = "failed"
# Seconds past a replica's traffic flush interval before a minute of traffic is judged.
TRAFFIC_SETTLE_MARGIN_S = 5.0


class EngineHolder:
    """Load the engine in a background thread and say how far it got.

    Example:
        holder = EngineHolder(factory, config, flags)
        holder.start()
        holder.get()      # None until loaded; serves (eager) while buckets warm
        holder.state()    # ("warming", "3/5 buckets warm")
    """

    def __init__(self, factory: EngineFactory, config: EngineConfig,
                 flags: FlagProvider) -> None:
        self._factory = factory
        self._config = config
        self._flags = flags
        self._engine: Engine | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self) -> None:
        """Begin loading and warming in a daemon thread."""
        self._thread = threading.Thread(target=self._load, name="tailwatch-engine-load",
                                        daemon=True)
        self._thread.start()

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            engine = self._factory(self._config, self._flags)
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            log.error("engine: failed to load: %s", self._error)
            return
        if self._closed.is_set():
            engine.close()
            return
        self._engine = engine
        log.info("engine: loaded in %.1f s; warming buckets", time.perf_counter() - started)
        try:
            engine.warm_up(background=False)
        except Exception as exc:
            # The engine still serves (eager for cold buckets); readiness reports it.
            self._error = f"warm-up failed: {type(exc).__name__}: {exc}"
            log.error("engine: %s", self._error)

    def get(self) -> Engine | None:
        """Return the engine once loaded, else None."""
        return self._engine

    def state(self) -> tuple[str, str]:
        """Return (one of LOADING, WARMING, READY, FAILED, a human reason)."""
        engine = self._engine
        if engine is None:
            if self._error is not None:
                return FAILED, f"engine failed to load: {self._error}"
            return LOADING, "engine loading"
        status = engine.warmup_status()
        if status.error is not None or self._error is not None:
            return FAILED, f"engine warm-up failed: {status.error or self._error}"
        if not status.done:
            return WARMING, f"{status.warm_buckets}/{status.total_buckets} buckets warm"
        return READY, "ready"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop waiting for the load and close the engine if it exists."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._engine is not None:
            self._engine.close()


class ProbeRunner:
    """Build the Prober once the engine is warm and run probes one at a time.

    Scheduled probes skip while the engine loads or warms (eager warm-up latencies
    would pollute baselines); requested ones raise NotReady (HTTP 503).
    """

    def __init__(self, holder: EngineHolder, build: Callable[[Engine], Prober]) -> None:
        self._holder = holder
        self._build = build
        self._prober: Prober | None = None
        self._lock = threading.Lock()

    def run(self, kind: str, *, suite: str | None = None,
            ab: bool | None = None) -> CycleResult | BurstResult:
        """Run a "cycle" or "burst" now, store it, and return it."""
        engine = self._holder.get()
        state, reason = self._holder.state()
        if engine is None or state != READY:
            raise NotReady(f"probes wait for a warm engine ({reason})")
        with self._lock:
            prober = self._get_prober(engine)
            if suite is not None and suite not in prober.suites:
                raise ValueError(f"suite: unknown suite {suite!r}; known: {sorted(prober.suites)}")
            if kind == "burst":
                return prober.run_burst(suite)
            return prober.run_cycle(suite, ab=ab)

    def _get_prober(self, engine: Engine) -> Prober:
        if self._prober is None:
            self._prober = self._build(engine)
        return self._prober

    def record_compiles(self) -> object:
        """Store recompiles that happened outside canary cycles (real traffic)."""
        engine = self._holder.get()
        if engine is None or self._holder.state()[0] != READY:
            return None
        prober = self._prober  # set once; a running cycle holds the lock for long
        if prober is None:
            with self._lock:
                prober = self._get_prober(engine)
        return prober.record_unprobed_compiles()

    def job(self, kind: str) -> Callable[[], object]:
        """Return a scheduler job running `kind` that skips while the engine is not ready."""

        def run() -> object:
            if self._holder.state()[0] != READY:
                log.info("probes: skipping a scheduled %s, engine not ready", kind)
                return None
            return self.run(kind)

        return run


def prepare_database(settings: Settings) -> DbEngine:
    """Return a DB engine whose schema is at head (migrating when auto_migrate).

    Raises storage.SchemaBehind (naming `tailwatch db upgrade`) when the schema is
    behind and auto_migrate is off, storage.DatabaseUnavailable (one line, password
    masked) when the database cannot be reached or refuses the connection.
    """
    db = make_engine(settings.database_url)
    try:
        if settings.auto_migrate:
            upgrade(db)
        check_schema(db)
    except DBAPIError as exc:
        db.dispose()
        # The driver's message spans lines and SQLAlchemy appends a link: keep the reason.
        raise DatabaseUnavailable(
            # Quoted: a masker scanning text for URLs stops at the quote, not at the colon.
            f"database: cannot connect to '{mask_url(db.url.render_as_string())}': "
            f"{one_line(str(exc.orig))}") from exc
    except Exception:
        # Not logged here: `serve` prints it as its one error line, uvicorn logs a lifespan failure.
        db.dispose()
        raise
    return db


def one_line(text: str) -> str:
    """Return `text` as one line: its lines joined, SQLAlchemy's "Background on" link dropped."""
    lines = [ln.strip() for ln in text.splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("(Background on this error"))


def preflight(settings: Settings) -> None:
    """Check what start-up would trip on (schema, rules, policy, suites); raise one error."""
    from alerts.config import load_config

    prepare_database(settings).dispose()
    load_config(settings.alerts)
    if settings.scheduler.enabled and settings.scheduler.probes_enabled:
        suites = load_suites(settings.probes.suites_file)
        if settings.probes.suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {settings.probes.suite!r}; "
                             f"known: {sorted(suites)}")


def make_flag_provider(sessions: sessionmaker[Session], ttl_s: float,
                       instance_id: str | None = None) -> FlagProvider:
    """Return the SQL-backed flag provider the engine reads on every request."""
    from alerts.flags import SqlFlagProvider

    # instance_id: an "instance:<id>" scoped flag (a per-instance eager fallback) applies here.
    return SqlFlagProvider(sessions, ttl_s=ttl_s, instance_id=instance_id)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Build the Services hub, put it on app.state, and close everything at shutdown."""
    from alerts.config import load_config
    from alerts.outbox import Deliverer
    from alerts.webhooks import source_labels, with_labels

    parts = parts_of(app)
    settings, metrics, seams = parts.settings, parts.metrics, parts.seams
    db = prepare_database(settings)
    closers: list[Callable[[], object]] = [db.dispose]
    collectors: list[Collector] = []
    scheduler: JobScheduler | None = None
    try:
        sessions = make_sessionmaker(db)
        writer = Writer(sessions, max_pending=settings.write_buffer_max)
        closers.append(lambda: _close_writer(writer))
        alerts = load_config(settings.alerts)  # bad rule, policy or webhook files fail here
        flags = make_flag_provider(sessions, alerts.flags_ttl_s, settings.instance_id)
        # Alerts carry service/job/instance as Prometheus labels this process's own series.
        targets = with_labels(alerts.targets, source_labels(settings.api.host, settings.api.port))
        alerts = replace(alerts, targets=tuple(targets))
        # run_wait_s: a hanging receiver's drain outlives its run instead of holding up the next.
        deliverer = Deliverer(sessions, alerts.targets, transport=seams.transport,
                              clock=seams.clock, max_age_s=alerts.webhook_max_age_s,
                              run_wait_s=2.0)
        closers.append(deliverer.close)
        holder = EngineHolder(seams.engine_factory, settings.engine, flags)
        closers.append(holder.close)
        traffic = TrafficRecorder(settings.instance_id,
                                  buffer_max=settings.probes.rollup_buffer_max)
        # Runs before the writer closes (closers run last-first): the last rollups.
        closers.append(lambda: traffic.flush(writer))
        quality = settings.quality
        sampler = (TrafficSampler(writer, share=quality.traffic_sample_share,
                                  queue_max=quality.sample_queue_max,
                                  instance_id=settings.instance_id,
                                  store_text=quality.store_text,
                                  timeout_s=settings.probes.cycle_timeout_s)
                   if quality.enabled and quality.traffic_sample_share > 0 else None)
        if sampler is not None:
            closers.append(sampler.close)  # before the writer closes: its rows go through it
        suites = seams.suites

        def build_prober(engine: Engine) -> Prober:
            quality = settings.quality
            checker = (OutputChecker(engine, sessions=sessions, writer=writer,
                                     timeout_s=settings.probes.cycle_timeout_s,
                                     store_text=quality.store_text)
                       if quality.enabled else None)
            return prober_from_settings(settings.probes, engine, writer,
                                        instance_id=settings.instance_id,
                                        observers=(parts.sink,), suites=suites,
                                        checker=checker)

        services = Services(
            settings=settings, authenticator=parts.authenticator, metrics=metrics,
            sink=parts.sink, seams=seams, db=db, sessions=sessions, flags=flags,
            engine_holder=holder, writer=writer, traffic=traffic,
            probes=ProbeRunner(holder, build_prober), alerts=alerts, deliverer=deliverer,
            sampler=sampler)
        collectors += [
            EngineCollector(metrics, holder.get),
            DatabaseCollector(metrics, sessions, flags, tuple(settings.engine.buckets)),
        ]
        if sampler is not None:
            live = sampler  # narrowed: the closure reads a non-None sampler
            collectors.append(SamplerCollector(metrics, lambda: live.stats))
        holder.start()
        if settings.scheduler.enabled:
            scheduler = (seams.scheduler_factory or start_scheduler)(services)
            services = replace(services, scheduler=scheduler)
        app.state.services = services
        log.info("tailwatch: serving (instance %s, scheduler %s)", settings.instance_id,
                 "on" if scheduler is not None else "off")
        yield
    finally:
        app.state.services = None
        if scheduler is not None:
            with suppress(Exception):
                scheduler.shutdown(wait=False)
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:
                log.warning("tailwatch: shutdown step failed: %s", exc)
        for collector in collectors:
            with suppress(KeyError):
                metrics.registry.unregister(collector)


def _close_writer(writer: Writer) -> None:
    """Write what is queued (best effort: a down database loses only these, counted)."""
    left = writer.close(timeout=5.0)
    stats = writer.stats
    if left or stats.dropped or stats.failed:
        log.warning("storage writer: %d writes left unwritten at shutdown; %d dropped and "
                    "%d failed since start", left, stats.dropped, stats.failed)


def start_scheduler(services: Services) -> JobScheduler:
    """Build and start the job scheduler from the services."""
    from monitor.leader import make_leader
    from monitor.scheduler import build_scheduler

    scheduler = build_scheduler(services.settings, scheduled_jobs(services),
                                make_leader(services.db))
    scheduler.start()
    return scheduler


def scheduled_jobs(services: Services) -> dict[str, Callable[[], object]]:
    """Return every job callable the scheduler runs (it drops those settings disable)."""
    from monitor import scheduler as names

    s = services
    jobs: dict[str, Callable[[], object]] = {
        names.PROBE: s.probes.job("cycle"),
        names.BURST: s.probes.job("burst"),
        names.TRAFFIC_FLUSH: lambda: (s.traffic.flush(s.writer), s.probes.record_compiles()),
        names.RETENTION: lambda: _prune(s),
        names.EVALUATE: lambda: _evaluate(s),
        names.DELIVERY: lambda: _deliver(s),
        names.REPORT: lambda: _report(s),
    }
    return jobs


def _prune(s: Services) -> object:
    from storage.retention import prune

    with s.sessions.begin() as session:
        return prune(session, s.seams.clock(), s.settings.retention.raw_days,
                     s.settings.retention.rollup_days)


def _evaluate(s: Services) -> object:
    from alerts.evaluator import evaluate
    from monitor.events import log_evaluation

    a = s.alerts
    # Every replica flushes its traffic rollups on its own schedule: a minute is judged
    # once each has flushed it (the interval, plus a margin for the write itself).
    settle = {"traffic": s.settings.scheduler.traffic_flush_interval_s + TRAFFIC_SETTLE_MARGIN_S}
    with s.sessions.begin() as session:
        report = evaluate(session, a.rules, s.seams.clock(), targets=a.targets,
                          policy=a.policy, baseline_config=a.baselines,
                          external_url=a.external_url, resend_s=a.resend_s,
                          stale_after_s=a.stale_after_s, settle=settle)
    # The policy may have flipped flags: let the engine see them on its next request.
    s.flags.invalidate()
    log_evaluation(report)  # alert fired/resolved, flags the policy changed
    return report


def _deliver(s: Services) -> object:
    report = s.deliverer.run_once()
    s.sink.deliveries(report)
    return report


def _report(s: Services) -> object:
    from monitor.report import run_weekly_report

    return run_weekly_report(s.sessions, s.settings)
