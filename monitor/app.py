"""The FastAPI application: `create_app(settings)` builds it, the lifespan fills it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from engine import malloc
from monitor.api import (
    alerts,
    baselines,
    errors,
    flags,
    generate,
    health,
    incidents,
    probes,
    reports,
)
from monitor.api.deliveries import router as deliveries_router
from monitor.api.instances import router as instances_router
from monitor.api.limits import BodyLimit, max_body_bytes
from monitor.api.openapi import install_openapi
from monitor.api.rollouts import router as rollouts_router
from monitor.api.sensitivity import router as sensitivity_router
from monitor.auth import Authenticator
from monitor.engine_holder import EngineFactory, default_engine_factory
from monitor.hub import AppParts, Seams, Services
from monitor.lifespan import lifespan
from monitor.metrics import Metrics, MetricsSink
from monitor.scheduler import JobScheduler
from monitor.settings import Settings
from probes.canaries import CanarySuite
from vocab import utcnow


def create_app(
    settings: Settings,
    *,
    engine_factory: EngineFactory | None = None,
    registry: CollectorRegistry | None = None,
    scheduler_factory: Callable[[Services], JobScheduler] | None = None,
    suites: Mapping[str, CanarySuite] | None = None,
    clock: Callable[[], datetime] | None = None,
    transport: httpx.BaseTransport | None = None,
    trim_heap: Callable[[], object] | None = None,
    analysis_in_process: bool = True,
) -> FastAPI:
    """Build the tailwatch service; nothing runs until the lifespan starts.

    Args:
        settings: effective settings (see `monitor.settings.get_settings`).
        engine_factory: (EngineConfig, FlagProvider) -> Engine; default loads the
            torch runtime. Tests pass a fake.
        registry: the Prometheus registry the app owns; a fresh one by default.
        scheduler_factory, suites, clock, transport, trim_heap: the other seams (see
            `monitor.hub.Seams`); production leaves them unset.
        analysis_in_process: the scheduler runs evaluation, delivery, retention and the
            report here too; `tailwatch serve` passes False and runs `tailwatch worker`.

    Raises:
        monitor.auth.AuthConfigError: auth is on and no token is configured.
    """
    authenticator = Authenticator.from_settings(settings)
    app = FastAPI(
        title="tailwatch",
        summary="Serve an optimized T5 and watch its optimizations.",
        version="0.1.0",
        lifespan=lifespan,
    )
    metrics = Metrics(registry if registry is not None else CollectorRegistry())
    seams = Seams(engine_factory=engine_factory or default_engine_factory,
                  scheduler_factory=scheduler_factory, suites=suites,
                  clock=clock or utcnow, transport=transport,
                  trim_heap=trim_heap or malloc.trim)
    app.state.parts = AppParts(settings=settings, authenticator=authenticator,
                               metrics=metrics, sink=MetricsSink(metrics), seams=seams,
                               analysis_in_process=analysis_in_process)
    errors.install_error_handlers(app)
    for module in (health, generate, flags, alerts, incidents, probes, baselines, reports):
        app.include_router(module.router)
    app.include_router(deliveries_router)
    app.include_router(instances_router)
    app.include_router(rollouts_router)
    app.include_router(sensitivity_router)
    app.add_middleware(BodyLimit, limit=max_body_bytes(settings))
    install_openapi(app)
    return app
