"""The FastAPI application: `create_app(settings)` builds it, the lifespan fills it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from monitor.api import alerts, baselines, errors, flags, generate, health, probes, reports
from monitor.auth import Authenticator
from monitor.metrics import Metrics, MetricsSink
from monitor.service import EngineFactory, default_engine_factory, lifespan
from monitor.settings import Settings


def create_app(
    settings: Settings,
    *,
    engine_factory: EngineFactory | None = None,
    registry: CollectorRegistry | None = None,
    **state: Any,
) -> FastAPI:
    """Build the tailwatch service; nothing runs until the lifespan starts.

    Args:
        settings: effective settings (see `monitor.settings.get_settings`).
        engine_factory: (EngineConfig, FlagProvider) -> Engine; default loads the
            torch runtime. Tests pass a fake.
        registry: the Prometheus registry the app owns; a fresh one by default.
        state: extra objects put on app.state before the lifespan (test seams such as
            `scheduler_factory`).

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
    app.state.settings = settings
    app.state.authenticator = authenticator
    app.state.engine_factory = engine_factory or default_engine_factory
    app.state.metrics = metrics
    app.state.sink = MetricsSink(metrics)
    for name, value in state.items():
        setattr(app.state, name, value)
    errors.install_error_handlers(app)
    for module in (health, generate, flags, alerts, probes, baselines, reports):
        app.include_router(module.router)
    return app
