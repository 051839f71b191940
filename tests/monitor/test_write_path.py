"""The service's one write path through a real database outage (PostgreSQL behind a proxy).

The app is the production wiring (`create_app` + lifespan + `scheduled_jobs`); only the
network between it and PostgreSQL is cut and restored. While the database is down,
/readyz and routes that read answer 503, scrapes still answer, and probe runs, memory
samples and traffic rollups wait in the storage Writer; past its bound they are dropped
and counted. When the database is back, everything kept arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from bench.proxy import TcpProxy
from monitor.hub import services_of
from monitor.jobs import scheduled_jobs
from monitor.loopback import wait_for
from storage.db import make_engine, make_sessionmaker
from storage.models import MemorySample, ProbeRun, TrafficRollup
from tests.monitor.conftest import make_settings, start

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_kind() -> str:
    """Run on PostgreSQL only: the proxy stands between the app and the server."""
    return "postgres"


@pytest.fixture
def proxy(migrated_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """Return a started proxy to the test database and the URL that goes through it."""
    real = make_url(migrated_url)
    p = TcpProxy((real.host or "127.0.0.1", real.port or 5432))
    p.start()
    url = real.set(host="127.0.0.1", port=p.port).render_as_string(hide_password=False)
    yield p, url
    p.stop()


def _counts(url: str) -> tuple[int, int, int]:
    db = make_engine(url)
    try:
        with make_sessionmaker(db)() as s:
            return (s.scalar(select(func.count()).select_from(ProbeRun)) or 0,
                    s.scalar(select(func.count()).select_from(MemorySample)) or 0,
                    s.scalar(select(func.sum(TrafficRollup.requests))) or 0)
    finally:
        db.dispose()


def test_outage_delays_then_delivers_every_write(
        proxy: tuple[TcpProxy, str], migrated_url: str, caplog: pytest.LogCaptureFixture) -> None:
    p, url = proxy
    registry = CollectorRegistry()
    # Flags cached for the whole test: the fake engine, unlike the runtime, does not keep
    # the last flags when the provider fails.
    # Output quality off: its agreement rows are a third kind of write; the counts below
    # follow a probe cycle's own run + memory samples.
    settings = make_settings(url, write_buffer_max=3, alerts={"flags_ttl_s": 3600},
                             quality={"enabled": False})
    app = start(settings, registry=registry)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        services = services_of(app)
        jobs = scheduled_jobs(services)
        writer = services.writer
        assert client.post("/v1/generate", json={"text": "warm the flag cache"}).status_code == 200
        jobs["traffic_flush"]()
        assert writer.flush(timeout=30)
        p.stop()  # the database goes away, pooled connections included
        r = client.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "database unreachable"
        a = client.get("/v1/alerts")
        assert a.status_code == 503 and a.json()["error"]["code"] == "database_unavailable"
        with caplog.at_level(logging.WARNING):
            m = client.get("/metrics")
        assert m.status_code == 200 and "tailwatch_engine_ready 1.0" in m.text
        assert registry.get_sample_value("tailwatch_scrape_errors_total",
                                         {"collector": "database"}) >= 1

        assert client.post("/v1/generate", json={"text": "hello river"}).status_code == 200
        jobs["traffic_flush"]()  # rollups -> writer
        jobs["probe"]()  # a canary cycle (its memory samples too) -> writer
        assert not writer.flush(timeout=0.5)
        stats = writer.stats
        assert stats.pending == 2 and stats.retries >= 1 and stats.dropped == 0
        jobs["probe"]()
        client.post("/v1/generate", json={"text": "the stone house"})
        jobs["traffic_flush"]()  # past write_buffer_max=3: dropped and counted
        assert (writer.stats.pending, writer.stats.dropped) == (3, 1)
        assert _counts(migrated_url) == (0, 0, 1)  # only the rollup from before the outage

        p.start()  # the database is back
        assert writer.flush(timeout=30)
        assert writer.stats.failed == 0
        # Two cycles with before/after memory samples each; the dropped rollup is lost.
        assert _counts(migrated_url) == (2, 4, 2)
        wait_for(lambda: client.get("/readyz").status_code == 200)
