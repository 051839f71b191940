"""The Services hub: every long-lived object of one running app, built by the lifespan.

`create_app` takes typed seams (`Seams`: engine factory, scheduler factory, canary
suites, clock, webhook transport, heap trim) and the lifespan (`monitor.lifespan`) builds
one frozen `Services` from settings and seams. Routes receive its parts through
`monitor.api.deps`; jobs (`monitor.jobs`) close over it; tests read it with
`services_of(app)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI
from sqlalchemy import Engine as DbEngine
from sqlalchemy.orm import Session, sessionmaker

from engine import malloc
from engine.protocol import FlagProvider
from monitor.engine_holder import EngineFactory, EngineHolder, default_engine_factory
from monitor.probe_runner import ProbeRunner
from monitor.prober import SchedulerActivity
from probes.canaries import CanarySuite
from vocab import utcnow

if TYPE_CHECKING:
    from alerts.config import AlertsConfig
    from alerts.outbox import Deliverer
    from monitor.auth import Authenticator
    from monitor.metrics import Metrics, MetricsSink
    from monitor.scheduler import JobScheduler
    from monitor.settings import Settings
    from probes.sampler import TrafficSampler
    from probes.traffic import TrafficRecorder
    from storage.writer import Writer


@dataclass(frozen=True)
class Seams:
    """What tests may replace; production runs the defaults.

    engine_factory: builds the engine (default loads the torch runtime).
    scheduler_factory: builds and starts the job scheduler from the services
        (default `monitor.lifespan.start_scheduler`).
    suites: canary suites (default: shipped plus probes.suites_file).
    clock: "now" for evaluation, retention and webhook deliveries.
    transport: the webhook deliveries' httpx transport (default: real network).
    trim_heap: the memory_trim job's call (default glibc's malloc_trim; False elsewhere).
    """

    engine_factory: EngineFactory = default_engine_factory
    scheduler_factory: Callable[[Services], JobScheduler] | None = None
    suites: Mapping[str, CanarySuite] | None = None
    clock: Callable[[], datetime] = utcnow
    transport: httpx.BaseTransport | None = None
    trim_heap: Callable[[], object] = malloc.trim


@dataclass(frozen=True)
class AppParts:
    """What `create_app` builds before the lifespan (settings, auth, metrics, seams).

    analysis_in_process: the scheduler also runs the analysis jobs (evaluate, delivery,
        retention, report) beside the engine; `tailwatch serve` turns it off and leaves
        them to `tailwatch worker`.
    """

    settings: Settings
    authenticator: Authenticator
    metrics: Metrics
    sink: MetricsSink
    seams: Seams
    analysis_in_process: bool = True


@dataclass(frozen=True)
class Services:
    """Every long-lived object of a running app (one per lifespan)."""

    settings: Settings
    authenticator: Authenticator
    metrics: Metrics
    sink: MetricsSink
    seams: Seams
    db: DbEngine
    sessions: sessionmaker[Session]
    flags: FlagProvider
    engine_holder: EngineHolder
    writer: Writer  # the one write path: probe rows, rollups, compile events, memory
    traffic: TrafficRecorder
    probes: ProbeRunner
    alerts: AlertsConfig
    deliverer: Deliverer
    scheduler: JobScheduler | None = None
    # Replays a sample of real requests on the reference path (None: share 0 or built by hand).
    sampler: TrafficSampler | None = None
    analysis_in_process: bool = True  # see AppParts
    # The jobs a probe cycle records as having run beside it (details.jobs_during).
    activity: SchedulerActivity = field(default_factory=SchedulerActivity)


def parts_of(app: FastAPI) -> AppParts:
    """Return what `create_app` put on the app."""
    parts: AppParts = app.state.parts
    return parts


def services_of(app: FastAPI) -> Services:
    """Return the running app's services; RuntimeError outside the lifespan."""
    services: Services | None = getattr(app.state, "services", None)
    if services is None:
        raise RuntimeError("the app is not running: enter its lifespan first")
    return services
