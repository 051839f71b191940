"""Lifespan wiring: build the DB, flags, engine, recorder and scheduler; tear them down.

Start-up order: database (schema checked or migrated) -> flag provider -> engine
(loaded in a background thread so /readyz can report "warming") -> traffic recorder
-> scrape-time collectors -> scheduler. Everything lands on `app.state`; routes read
it through the dependency aliases in `monitor.api.deps`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI

from engine.config import EngineConfig
from engine.errors import NotReady
from engine.protocol import Engine, FlagProvider
from monitor.metrics import DatabaseCollector, EngineCollector, Metrics
from monitor.settings import Settings
from probes.burst import BurstResult
from probes.canaries import load_suites
from probes.cycle import CycleResult
from probes.prober import Prober
from probes.traffic import TrafficRecorder, sql_store
from storage.db import make_engine, make_sessionmaker
from storage.migrate import check_schema, upgrade

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig, FlagProvider], Engine]

LOADING = "loading"
WARMING = "warming"
READY = "ready"
FAILED = "failed"


def default_engine_factory(config: EngineConfig, flags: FlagProvider) -> Engine:
    """Load the torch-backed engine (imports torch)."""
    from engine import load_engine

    return load_engine(config, flags=flags)


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


def build_prober(engine: Engine, app: FastAPI) -> Prober:
    """Return the Prober for `engine`, storing through the app's sessions."""
    from probes.prober import prober_from_settings

    return prober_from_settings(app.state.settings, engine, app.state.sessions,
                                observers=(app.state.sink,),
                                suites=getattr(app.state, "suites", None))


def prepare_database(settings: Settings) -> Any:
    """Return a DB engine whose schema is at head (migrating when auto_migrate).

    Raises storage.SchemaBehind (naming `tailwatch db upgrade`) when the schema is
    behind and auto_migrate is off.
    """
    db = make_engine(settings.database_url)
    try:
        if settings.auto_migrate:
            upgrade(db)
        check_schema(db)
    except Exception as exc:
        log.error("tailwatch: cannot start: %s", exc)
        db.dispose()
        raise
    return db


def preflight(settings: Settings) -> None:
    """Check what start-up would trip on (schema, rules, policy, suites); raise one error."""
    from alerts.policy import load_policy
    from alerts.rules import load_rules

    prepare_database(settings).dispose()
    load_rules(settings.alerts.rules_file)
    load_policy(settings.alerts.policy_file)
    if settings.scheduler.enabled and settings.scheduler.probes_enabled:
        suites = load_suites(settings.probes.suites_file)
        if settings.probes.suite not in suites:
            raise ValueError(f"probes.suite: unknown suite {settings.probes.suite!r}; "
                             f"known: {sorted(suites)}")


def make_flag_provider(sessions: Any, settings: Settings) -> FlagProvider:
    """Return the SQL-backed flag provider the engine reads on every request."""
    from alerts.flags import SqlFlagProvider

    return SqlFlagProvider(sessions, ttl_s=settings.alerts.flags_ttl_s)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Build every long-lived object, hang it on app.state, and close it at shutdown."""
    state = app.state
    settings: Settings = state.settings
    metrics: Metrics = state.metrics
    db = prepare_database(settings)
    sessions = make_sessionmaker(db)
    state.db_engine, state.sessions = db, sessions
    flags = make_flag_provider(sessions, settings)
    state.flags = flags
    holder = EngineHolder(state.engine_factory, settings.engine.to_config(), flags)
    state.engine_holder = holder
    state.traffic = TrafficRecorder(settings.instance_id,
                                    buffer_max=settings.probes.rollup_buffer_max)
    collectors = [
        EngineCollector(metrics, holder.get),
        # Through app.state, so a swapped sessionmaker (tests) is what scrapes read.
        DatabaseCollector(metrics, lambda: state.sessions(), flags,
                          tuple(settings.engine.buckets)),
    ]
    state.probes = ProbeRunner(holder, lambda engine: build_prober(engine, app))
    state.scheduler = scheduler = None
    try:
        holder.start()
        if settings.scheduler.enabled:
            factory = getattr(state, "scheduler_factory", None) or start_scheduler
            state.scheduler = scheduler = factory(app)
        log.info("tailwatch: serving (instance %s, scheduler %s)", settings.instance_id,
                 "on" if scheduler is not None else "off")
        yield
    finally:
        if scheduler is not None:
            with suppress(Exception):
                scheduler.shutdown(wait=False)
        deliverer = getattr(state, "deliverer", None)
        if deliverer is not None:
            deliverer.close()
        holder.close()
        _flush_traffic(app)
        for collector in collectors:
            with suppress(KeyError):
                metrics.registry.unregister(collector)
        db.dispose()


def start_scheduler(app: FastAPI) -> Any:
    """Build and start the job scheduler from what the app holds."""
    from monitor.leader import make_leader
    from monitor.scheduler import build_scheduler

    scheduler = build_scheduler(app.state.settings, scheduled_jobs(app),
                                make_leader(app.state.db_engine))
    scheduler.start()
    return scheduler


def scheduled_jobs(app: FastAPI) -> dict[str, Callable[[], object]]:
    """Return every job callable the scheduler runs (it drops those settings disable)."""
    from monitor import scheduler as names

    state = app.state
    settings: Settings = state.settings
    sessions = state.sessions
    store = sql_store(sessions)
    jobs: dict[str, Callable[[], object]] = {
        names.PROBE: state.probes.job("cycle"),
        names.BURST: state.probes.job("burst"),
        names.TRAFFIC_FLUSH: lambda: (state.traffic.flush(store), state.probes.record_compiles()),
        names.RETENTION: lambda: _prune(sessions, settings),
    }
    jobs.update(_alert_jobs(app))
    jobs[names.REPORT] = _report_job(app)
    return jobs


def _prune(sessions: Any, settings: Settings) -> object:
    from storage.retention import prune

    with sessions.begin() as session:
        return prune(session, datetime.now(UTC), settings.retention.raw_days,
                     settings.retention.rollup_days)


def _flush_traffic(app: FastAPI) -> None:
    """Store the last rollups at shutdown (best effort: a down DB loses only these)."""
    try:
        app.state.traffic.flush(sql_store(app.state.sessions))
    except Exception as exc:
        log.warning("traffic: could not store the last rollups at shutdown: %s", exc)


def _alert_jobs(app: FastAPI) -> dict[str, Callable[[], object]]:
    """Return the evaluate and delivery jobs; bad rule, policy or webhook files fail here."""
    from alerts.baselines import BaselineConfig
    from alerts.evaluator import evaluate
    from alerts.outbox import Deliverer
    from alerts.policy import load_policy
    from alerts.rules import load_rules
    from alerts.webhooks import parse_targets
    from monitor import scheduler as names

    settings: Settings = app.state.settings
    sessions = app.state.sessions
    rules = load_rules(settings.alerts.rules_file)
    policy = load_policy(settings.alerts.policy_file)
    targets = parse_targets(settings.alerts.webhooks)
    deliverer = Deliverer(sessions, targets)
    app.state.deliverer = deliverer
    flags = app.state.flags
    a = settings.alerts
    baseline_config = BaselineConfig(refresh_s=a.baseline_refresh_s,
                                     warm_in_s=a.baseline_warm_in_s)

    def run_evaluate() -> object:
        with sessions.begin() as session:
            report = evaluate(session, rules, datetime.now(UTC), targets=targets,
                              policy=policy, baseline_config=baseline_config,
                              external_url=a.external_url, resend_s=a.resend_interval_s)
        # The policy may have flipped flags: let the engine see them on its next request.
        invalidate = getattr(flags, "invalidate", None)
        if invalidate is not None:
            invalidate()
        return report

    def run_delivery() -> object:
        report = deliverer.run_once()
        app.state.sink.deliveries(report)
        return report

    return {names.EVALUATE: run_evaluate, names.DELIVERY: run_delivery}


def _report_job(app: FastAPI) -> Callable[[], object]:
    """Return the weekly report job (monitor.report)."""
    from monitor.report import run_weekly_report

    settings: Settings = app.state.settings
    sessions = app.state.sessions
    return lambda: run_weekly_report(sessions, settings)
