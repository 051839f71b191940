"""The Services hub: one frozen object built by the lifespan from settings and typed seams."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from alerts.outbox import enqueue
from alerts.webhooks import Notification
from monitor.hub import Services, parts_of, services_of
from monitor.jobs import scheduled_jobs
from monitor.loopback import WebhookReceiver, wait_for
from storage.models import WebhookDelivery
from tests.monitor.conftest import make_settings, start

# Notifications go through the service's real deliverer, whose clock is the wall clock:
# a fixed date would turn into a dead letter (max age 24 h) a day after it was written.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)


@pytest.fixture
def db_kind() -> str:
    """Run on SQLite only (the write-path test covers PostgreSQL)."""
    return "sqlite"


def test_lifespan_builds_one_frozen_hub_and_clears_it(migrated_url: str) -> None:
    app = start(make_settings(migrated_url))
    with pytest.raises(RuntimeError, match="lifespan"):
        services_of(app)
    assert parts_of(app).seams.suites is not None  # the typed seam, before start-up
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        s = services_of(app)
        assert isinstance(s, Services) and s.scheduler is None  # scheduler off in tests
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.writer = None  # type: ignore[misc]
        assert s.engine_holder.get() is not None and s.probes is not None
    with pytest.raises(RuntimeError):
        services_of(app)


def test_delivery_job_uses_the_hubs_deliverer_and_targets(migrated_url: str) -> None:
    rx = WebhookReceiver()
    with rx:
        url = rx.url
        settings = make_settings(migrated_url, alerts={"webhooks": [{"name": "ops", "url": url}]})
        app = start(settings)
        with TestClient(app) as client:
            wait_for(lambda: client.get("/readyz").status_code == 200)
            s = services_of(app)
            (target,) = s.alerts.targets
            # The service's own labels ride on every target (service, job, instance).
            assert target.name == "ops" and target.labels["job"] == "tailwatch"
            with s.sessions.begin() as session:
                enqueue(session, Notification(key="k1", title="hello", text="t", at=T0),
                        s.alerts.targets)
            report = scheduled_jobs(s)["delivery"]()
            assert getattr(report, "delivered", None) == 1
            with s.sessions() as session:
                assert session.scalars(select(WebhookDelivery.state)).all() == ["delivered"]
    assert [p["title"] for p in rx.payloads()] == ["hello"]
