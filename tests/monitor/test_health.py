"""/healthz, /readyz and the lifespan: warming, DB outages, refusing to start."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import StaticPool

from monitor.app import create_app
from monitor.auth import AuthConfigError
from monitor.hub import services_of
from monitor.loopback import wait_for
from monitor.settings import Settings
from storage.db import make_engine, ping
from storage.errors import SchemaBehind
from tests.monitor.conftest import make_settings
from tests.monitor.fakes import FakeFactory


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


def test_readyz_reports_warming_until_every_bucket_is_warm(settings: Settings) -> None:
    factory = FakeFactory(hold_warmup=True)
    app = create_app(settings, engine_factory=factory, registry=CollectorRegistry())
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert factory.built.wait(10)
        wait_for(lambda: services_of(app).engine_holder.get() is not None)
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["status"] == "warming"
        assert r.json()["reason"] == "0/3 buckets warm"
        assert factory.engine is not None
        factory.engine.finish_warmup.set()
        wait_for(lambda: client.get("/readyz").status_code == 200)
        assert client.get("/readyz").json()["status"] == "ready"
    assert factory.engine.closed, "the lifespan closes the engine at shutdown"


def test_generate_is_503_with_retry_after_while_the_engine_loads(settings: Settings) -> None:
    def never_loads(config: object, flags: object) -> object:
        raise RuntimeError("model directory missing config.json")

    app = create_app(settings, engine_factory=never_loads,  # type: ignore[arg-type]
                     registry=CollectorRegistry())
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").json()["status"] == "failed")
        r = client.get("/readyz")
        assert r.status_code == 503
        assert "model directory missing config.json" in r.json()["reason"]
        g = client.post("/v1/generate", json={"text": "hello"})
        assert g.status_code == 503
        assert g.json()["error"]["code"] == "not_ready"
        assert int(g.headers["Retry-After"]) >= 1


def test_refuses_to_start_with_auth_on_and_no_token(migrated_url: str) -> None:
    settings = make_settings(migrated_url, api_token=None, api={"auth": True, "tokens": []})
    with pytest.raises(AuthConfigError, match="TAILWATCH_API_TOKEN"):
        create_app(settings, engine_factory=FakeFactory())


def test_auth_off_needs_no_token(migrated_url: str) -> None:
    settings = make_settings(migrated_url, api_token=None, api={"auth": False})
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        r = client.put("/v1/flags/compiled", json={"value": False, "reason": "test"})
        assert r.status_code == 200
        assert r.json()["actor"] == "anonymous"


def test_refuses_to_start_on_a_schema_behind_head(sqlite_url: str) -> None:
    app = create_app(make_settings(sqlite_url), engine_factory=FakeFactory(),
                     registry=CollectorRegistry())
    with pytest.raises(SchemaBehind, match="tailwatch db upgrade"), TestClient(app):
        pass


def test_auto_migrate_upgrades_an_empty_database(sqlite_url: str) -> None:
    settings = make_settings(sqlite_url, auto_migrate=True)
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        assert client.get("/v1/flags").json()["flags"] == []


def test_lifespan_can_run_twice_on_one_registry(settings: Settings) -> None:
    registry = CollectorRegistry()
    app = create_app(settings, engine_factory=FakeFactory(), registry=registry)
    for _ in range(2):
        with TestClient(app) as client:
            wait_for(lambda c=client: c.get("/readyz").status_code == 200)
            assert registry.get_sample_value("tailwatch_engine_ready") == 1
    # Scrape-time collectors are unregistered at shutdown, so nothing reads a closed engine.
    assert registry.get_sample_value("tailwatch_engine_ready") is None


def test_a_failed_start_cleans_up(migrated_url: str) -> None:
    settings = make_settings(migrated_url, scheduler={"enabled": True},
                             alerts={"rules_file": "/nonexistent/rules.yaml"})
    registry = CollectorRegistry()
    factory = FakeFactory()
    app = create_app(settings, engine_factory=factory, registry=registry)
    with pytest.raises(ValueError, match="rules"), TestClient(app):
        pass
    assert registry.get_sample_value("tailwatch_engine_ready") is None
    wait_for(lambda: factory.engine is None or factory.engine.closed)


def test_readyz_is_200_while_another_connection_holds_the_sqlite_write_lock(
        settings: Settings) -> None:
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    writer = make_engine(settings.database_url)  # as the worker's evaluation opens it
    other = make_engine(settings.database_url, busy_timeout_s=0)
    try:
        with TestClient(app) as client:
            wait_for(lambda: client.get("/readyz").status_code == 200)
            with writer.begin() as held:  # BEGIN IMMEDIATE: the write lock, kept open
                held.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
                with pytest.raises(OperationalError, match="locked"), other.begin():
                    pass  # the lock is really held
                r = client.get("/readyz")
            assert r.status_code == 200, r.json()
            assert r.json()["database"] == "ok"
    finally:
        writer.dispose()
        other.dispose()


def test_the_readiness_ping_leaves_transactions_to_sqlalchemy(sqlite_url: str) -> None:
    db = make_engine(sqlite_url, poolclass=StaticPool)  # one connection: the one pinged
    try:
        ping(db)
        # pysqlite's own implicit BEGINs stay off on the connection the ping returned.
        assert getattr(db.raw_connection().dbapi_connection, "isolation_level", "") is None
    finally:
        db.dispose()
