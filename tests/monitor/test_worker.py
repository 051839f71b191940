"""`tailwatch worker`: the analysis jobs in their own process, leader-locked, observable."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from monitor.database import prepare_database
from monitor.leader import LeaderLock, PgAdvisoryLeader, make_leader
from monitor.loopback import free_port
from monitor.settings import Settings
from monitor.worker import AnalysisWorker, WorkerPortError, WorkerSeams
from storage.errors import DatabaseUnavailable
from storage.migrate import check_schema, head
from tests.monitor.conftest import TOKEN, make_settings, wait_for

ROOT = Path(__file__).resolve().parents[2]

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
        assert set(table) == {"evaluate", "delivery", "retention", "report", "sensitivity",
                              "memory_trim"}
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
        # The worker's own memory: its RSS and the SQLite caches its evaluations filled.
        assert get("tailwatch_process_memory_bytes", {"kind": "rss"}) > 10e6
        if migrated_url.startswith("sqlite"):
            assert get("tailwatch_process_memory_bytes", {"kind": "sqlite"}) > 0
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


@contextmanager
def worker_process(url: str, port: int, log: Path, *,
                   fast: bool = True) -> Iterator[subprocess.Popen[bytes]]:
    """Run `tailwatch worker` on `url` as a process of its own (fast: evaluation and
    delivery every 0.2 s)."""
    env = {**os.environ, "TAILWATCH_DATABASE_URL": url, "TAILWATCH_API_TOKEN": TOKEN,
           "PYTHONPATH": str(ROOT)}
    if fast:
        env |= {"TAILWATCH_SCHEDULER__EVALUATE_INTERVAL_S": "0.2",
                "TAILWATCH_SCHEDULER__DELIVERY_INTERVAL_S": "0.2"}
    env.pop("TAILWATCH_CONFIG", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monitor.cli", "worker", "--port", str(port),
             "--exit-with-parent"], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60.0)
        assert proc.stdin is not None
        proc.stdin.close()


def evaluate_row(port: int) -> dict[str, Any]:
    """Return the `evaluate` row of a worker process's job table ({} until it answers)."""
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).json()
    except httpx.HTTPError:
        return {}
    return next((j for j in body["jobs"] if j["name"] == "evaluate"), {})


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_a_second_worker_process_on_one_sqlite_file_waits_and_takes_over_from_a_killed_one(
        migrated_url: str, tmp_path: Path) -> None:
    # As a `tailwatch worker` run by a process manager beside the one `serve` starts.
    ports = free_port(), free_port()
    logs = tmp_path / "a.log", tmp_path / "b.log"
    with worker_process(migrated_url, ports[0], logs[0]) as a:
        wait_for(lambda: evaluate_row(ports[0]).get("runs", 0) >= 1, 120.0,
                 what="the first worker evaluates")
        with worker_process(migrated_url, ports[1], logs[1]):
            wait_for(lambda: evaluate_row(ports[1]).get("not_leader", 0) >= 3, 120.0,
                     what="the second worker waits")
            assert evaluate_row(ports[1])["runs"] == 0
            assert evaluate_row(ports[0])["leader"] is True
            a.kill()  # no shutdown code runs: only the kernel frees the lock
            a.wait(60.0)
            wait_for(lambda: evaluate_row(ports[1]).get("runs", 0) >= 1, 60.0,
                     what="the second worker takes over")
            assert evaluate_row(ports[1])["leader"] is True
    second = logs[1].read_text()
    assert second.count("another process leads the scheduler") == 1, second
    assert f"(pid {a.pid}, lock file " in second
    assert "became scheduler leader" in second

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


def sqlite_path(url: str) -> str:
    path = make_url(url).database
    assert path is not None
    return path


def write_transaction(url: str) -> sqlite3.Connection:
    """Return a connection holding SQLite's write lock (as `serve`'s writer does mid-batch)."""
    holder = sqlite3.connect(sqlite_path(url), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE alembic_version SET version_num = version_num")
    return holder


def exclusive_lock(url: str) -> sqlite3.Connection:
    """Return a connection that keeps every other one out, readers too, until it closes."""
    locker = sqlite3.connect(sqlite_path(url), isolation_level=None, check_same_thread=False)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")  # WAL: no shared memory, no readers
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("UPDATE alembic_version SET version_num = version_num")
    return locker


class LockLog(logging.Handler):
    """Collect monitor.database's lines; set `retried` once it tried `tries` times locked."""

    def __init__(self, tries: int) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.tries = tries
        self.retried = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if sum("locked" in r.getMessage() for r in self.records) >= self.tries:
            self.retried.set()

    def lines(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextmanager
def lock_log(tries: int) -> Iterator[LockLog]:
    logger = logging.getLogger("monitor.database")
    handler, level = LockLog(tries), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("db_kind", ["sqlite"])
@pytest.mark.parametrize("auto_migrate", [False, True])
def test_the_worker_starts_while_another_connection_holds_the_write_lock(
        migrated_url: str, auto_migrate: bool) -> None:
    # The schema check took the write lock (BEGIN IMMEDIATE) and, behind a writer that
    # kept it past the busy timeout, exited 1 on "database is locked".
    holder = write_transaction(migrated_url)
    worker = AnalysisWorker(worker_settings(migrated_url, auto_migrate=auto_migrate))
    try:
        worker.start()
        assert worker.health()["status"] == "ok"
        holder.execute("COMMIT")
        wait_for(lambda: jobs(worker)["evaluate"]["runs"] >= 1, 60.0)
    finally:
        holder.close()
        worker.close()


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_setup_waits_for_a_locked_database_and_says_so_once(migrated_url: str) -> None:
    settings = make_settings(migrated_url)
    locker = exclusive_lock(migrated_url)
    prepared: list[Engine] = []
    try:
        with lock_log(tries=3) as log:
            setup = threading.Thread(target=lambda: prepared.append(
                prepare_database(settings, busy_timeout_s=0.05)))
            setup.start()
            assert log.retried.wait(60.0), "the setup never retried the locked database"
            assert setup.is_alive() and not prepared
            locker.close()  # exclusive mode keeps the lock until the connection closes
            setup.join(60.0)
    finally:
        locker.close()
    assert prepared, "the setup did not finish once the lock was released"
    try:
        assert check_schema(prepared[0]) == head()
    finally:
        prepared[0].dispose()
    assert len(log.lines(logging.WARNING)) == 1
    assert "locked by another connection; waiting" in log.lines(logging.WARNING)[0]
    assert len(log.lines(logging.DEBUG)) >= 2  # the tries between: debug only
    assert [m for m in log.lines(logging.INFO) if "lock was released" in m]


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_a_stop_ends_the_wait_for_a_locked_database_with_one_line(migrated_url: str) -> None:
    stop = threading.Event()
    stop.set()
    locker = exclusive_lock(migrated_url)
    try:
        with pytest.raises(DatabaseUnavailable, match=r"^database: .*database is locked$"):
            prepare_database(make_settings(migrated_url), stop=stop, busy_timeout_s=0.05)
    finally:
        locker.close()


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_the_worker_process_waits_for_a_locked_database_instead_of_exiting(
        migrated_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "worker.log"
    locker = exclusive_lock(migrated_url)
    try:
        with worker_process(migrated_url, port, log, fast=False) as proc:
            # The first try gives up after the busy timeout; the worker then says it waits.
            wait_for(lambda: proc.poll() is not None or "waiting for it" in log.read_text(),
                     120.0, interval_s=0.1, what="the worker's first locked try")
            assert proc.poll() is None, log.read_text()
            locker.close()
            wait_for(lambda: worker_answers(port), 120.0, interval_s=0.1,
                     what="the worker answers /healthz")
            assert proc.stdin is not None
            proc.stdin.close()  # as `serve` exiting does
            assert proc.wait(60.0) == 0, log.read_text()
    finally:
        locker.close()
    assert log.read_text().count("locked by another connection; waiting") == 1


def worker_answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stopping_worker_does_not_wait_past_its_grace_for_a_running_job(
        caplog: pytest.LogCaptureFixture) -> None:
    import threading

    from monitor.cli.worker import close_within

    exits: list[int] = []
    # A close that returns: nothing else happens.
    assert close_within(lambda: None, 5.0, exits.append) is True and exits == []
    # A close stuck behind a job (a sensitivity run on a saturated host): the process
    # exits once the grace has passed, and says why.
    release = threading.Event()
    with caplog.at_level("WARNING", logger="monitor.cli.worker"):
        assert close_within(lambda: release.wait(30.0) and None, 0.2, exits.append) is False
    release.set()
    assert exits == [0]
    assert "a job still runs 0.2 s after the stop; exiting without it" in caplog.text
