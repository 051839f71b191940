"""Service test fixtures: settings on a migrated database, an app on a fake engine.

`settings` follows tests/utils/db.py's `db_kind` (SQLite and PostgreSQL); modules that
need only one database override `db_kind` locally (never here: report and scheduler
tests share this directory).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.app import create_app
from monitor.loopback import wait_for
from monitor.settings import Settings
from probes.canaries import CanarySuite
from tests.monitor.fakes import FakeFactory

TOKEN = "tw-test-token-7f3a9c"
OTHER_TOKEN = "tw-oncall-token-11b2"


def make_settings(database_url: str, **overrides: Any) -> Settings:
    """Return test settings: small buckets, no scheduler, two named tokens, no nice."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "instance_id": "test-instance",
        "api_token": TOKEN,
        "api": {"tokens": [{"name": "oncall", "token": OTHER_TOKEN}]},
        "engine": {"buckets": (16, 32, 64), "max_input_tokens": 128, "max_new_tokens": 8,
                   "max_new_tokens_cap": 64, "max_queue": 4},
        "scheduler": {"enabled": False},
    }
    # Analysis threads at the process's priority: at the shipped nice 10 they starve behind
    # the other work on a shared test host and miss the tests' deadlines. test_priority.py
    # sets a nice value on purpose.
    worker = {"nice": 0, **overrides.pop("worker", {})}
    values.update(overrides, worker=worker)
    return Settings(**values)


@pytest.fixture
def settings(migrated_url: str) -> Settings:
    """Return test settings on a migrated database."""
    return make_settings(migrated_url)


@pytest.fixture
def factory() -> FakeFactory:
    """Return the fake engine factory (its `.engine` is the engine the app serves)."""
    return FakeFactory()


@pytest.fixture
def registry() -> CollectorRegistry:
    """Return a fresh Prometheus registry for one app."""
    return CollectorRegistry()


def suites() -> dict[str, CanarySuite]:
    """Return small canary suites covering the test buckets (16, 32, 64 byte tokens)."""
    words = "the river runs past the old stone house and on into the green field "
    prompts = tuple(words[:n].strip() for n in (8, 12, 24, 28, 50, 60))
    return {"in_domain": CanarySuite("in_domain", "in_domain", prompts),
            "shifted": CanarySuite("shifted", "shifted",
                                   tuple(p.upper().replace(" ", "_") for p in prompts))}


def start(settings: Settings, factory: FakeFactory | None = None,
          registry: CollectorRegistry | None = None) -> FastAPI:
    """Return create_app(...) on a fake engine with the test suites."""
    return create_app(settings, engine_factory=factory or FakeFactory(),
                      registry=registry or CollectorRegistry(), suites=suites())


@pytest.fixture
def client(settings: Settings, factory: FakeFactory,
           registry: CollectorRegistry) -> Iterator[TestClient]:
    """Return a started app (lifespan entered) whose engine is loaded and warm."""
    app = start(settings, factory, registry)
    with TestClient(app) as c:
        wait_for(lambda: c.get("/readyz").status_code == 200)
        yield c


@pytest.fixture
def auth() -> dict[str, str]:
    """Return the Authorization header of the unnamed API token."""
    return {"Authorization": f"Bearer {TOKEN}"}
