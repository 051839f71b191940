"""`tailwatch worker`: the analysis jobs in their own process, leader-locked, observable."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine

from monitor.leader import LeaderLock, PgAdvisoryLeader, make_leader
from monitor.settings import Settings
from monitor.worker import AnalysisWorker, WorkerPortError, WorkerSeams
from tests.monitor.conftest import make_settings, wait_for

FAST = {"enabled": True, "evaluate_interval_s": 0.2, "delivery_interval_s": 0.2}


def worker_settings(url: str, **overrides: Any) -> Settings:
    return make_settings(url, scheduler=FAST, worker={"port": 0}, **overrides)


@contextmanager
def running(settings: Settings, lock_name: str | None = None) -> Iterator[AnalysisWorker]:
    def leader(db: Engine) -> LeaderLock:
        if lock_name is not None and db.dialect.name == "postgresql":
            return PgAdvisoryLeader(db, name=lock_name)  # apart from other test runs
        return make_leader(db)

    worker = AnalysisWorker(settings, seams=WorkerSeams(leader=leader))
    worker.start()
    try:
        yield worker
    finally:
        worker.close()


def jobs(worker: AnalysisWorker) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"http://127.0.0.1:{worker.port}/healthz", timeout=5.0).json()
    return {j["name"]: j for j in body["jobs"]}


def test_the_worker_runs_the_analysis_jobs_and_reports_them(migrated_url: str) -> None:
    with running(worker_settings(migrated_url), f"test-worker-{time.monotonic_ns()}") as w:
        wait_for(lambda: all(jobs(w)[j]["runs"] >= 2 for j in ("evaluate", "delivery")))
        table = jobs(w)
        assert set(table) == {"evaluate", "delivery", "retention", "report", "sensitivity"}
        assert table["evaluate"]["leader"] is True and table["evaluate"]["failures"] == 0
        assert table["evaluate"]["last_success"] and table["evaluate"]["last_duration_s"] > 0
        r = httpx.get(f"http://127.0.0.1:{w.port}/metrics", timeout=5.0)
        assert r.status_code == 200
        get = w.registry.get_sample_value
        evaluate, delivery = {"scheduled_job": "evaluate"}, {"scheduled_job": "delivery"}
        assert get("tailwatch_job_duration_seconds_count", evaluate) >= 2
        assert get("tailwatch_job_last_success_timestamp_seconds", delivery) > 0
        assert get("tailwatch_job_failures_total", evaluate) == 0
        assert 'tailwatch_job_duration_seconds_bucket{le="0.001",scheduled_job="evaluate"}' \
            in r.text
        assert httpx.get(f"http://127.0.0.1:{w.port}/nope", timeout=5.0).status_code == 404
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{w.port}/healthz", timeout=2.0)


def test_worker_metrics_need_a_token_when_read_auth_is_on(migrated_url: str) -> None:
    settings = worker_settings(migrated_url, api={"read_auth": True})
    with running(settings, f"test-worker-auth-{time.monotonic_ns()}") as w:
        url = f"http://127.0.0.1:{w.port}/metrics"
        assert httpx.get(url, timeout=5.0).status_code == 401
        token = settings.all_tokens()["api-token"]
        ok = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=5.0)
        assert ok.status_code == 200 and "tailwatch_job_duration_seconds" in ok.text


def test_a_taken_port_is_one_error_naming_the_field(migrated_url: str) -> None:
    with running(worker_settings(migrated_url)) as first:
        settings = make_settings(migrated_url, scheduler=FAST, worker={"port": first.port})
        with pytest.raises(WorkerPortError, match=r"^worker\.port: cannot listen on"):
            AnalysisWorker(settings).start()


@pytest.mark.parametrize("db_kind", [pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_workers_on_postgres_run_each_singleton_on_one(migrated_url: str) -> None:
    name = f"test-workers-{time.monotonic_ns()}"
    settings = worker_settings(migrated_url)
    with running(settings, name) as a:
        wait_for(lambda: jobs(a)["evaluate"]["runs"] >= 1)
        with running(settings, name) as b:
            wait_for(lambda: jobs(b)["evaluate"]["not_leader"] >= 3)
            assert jobs(b)["evaluate"]["runs"] == 0 and jobs(b)["evaluate"]["leader"] is False
            assert jobs(a)["evaluate"]["leader"] is True
            a.close()  # gives up the advisory lock
            wait_for(lambda: jobs(b)["evaluate"]["runs"] >= 1)
            assert jobs(b)["evaluate"]["leader"] is True


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_starting_the_worker_never_imports_torch(sqlite_url: str, db_kind: str) -> None:
    code = (
        "import sys\n"
        "from storage.migrate import upgrade\n"
        "from monitor.worker import AnalysisWorker\n"
        "from monitor.settings import Settings\n"
        "import monitor.cli.worker\n"
        f"upgrade({sqlite_url!r})\n"
        f"w = AnalysisWorker(Settings(database_url={sqlite_url!r}, api_token='t',"
        " worker={'port': 0}))\n"
        "w.start(); w.close()\n"
        "print(','.join(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"the worker imported {out.stdout.strip()}"
