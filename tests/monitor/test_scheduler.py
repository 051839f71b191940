"""Scheduler wiring: job options, no overlap, leader-only singletons across replicas."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from apscheduler.events import EVENT_JOB_MAX_INSTANCES
from apscheduler.triggers.base import BaseTrigger
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from monitor.job_metrics import JobMetrics
from monitor.leader import AlwaysLeader, PgAdvisoryLeader, lock_key, make_leader
from monitor.loopback import wait_for
from monitor.scheduler import (
    BURST,
    DELIVERY,
    EVALUATE,
    MEMORY_TRIM,
    PROBE,
    REPORT,
    RETENTION,
    TRAFFIC_FLUSH,
    build_scheduler,
    job_table,
)
from monitor.settings import Settings
from storage.db import make_engine


def settings(**scheduler: object) -> Settings:
    return Settings(database_url="sqlite://", scheduler=scheduler)


class NotLeader:
    def is_leader(self) -> bool:
        return False

    def release(self) -> None:
        return None


def noop() -> None:
    return None


def test_jobs_get_settings_triggers_and_options() -> None:
    s = settings(misfire_grace_s=7, burst_interval_s=0)
    jobs = {name: noop for name in (PROBE, "burst", TRAFFIC_FLUSH, EVALUATE, DELIVERY,
                                    RETENTION, REPORT)}
    js = build_scheduler(s, jobs, AlwaysLeader())
    assert sorted(js.jobs()) == sorted(set(jobs) - {"burst"})  # burst_interval_s=0: off
    for job in js.aps.get_jobs():
        assert (job.max_instances, job.coalesce, job.misfire_grace_time) == (1, True, 7)
    report = js.aps.get_job(REPORT).trigger
    assert "day_of_week='mon'" in str(report) and "hour='6'" in str(report)
    assert js.aps.get_job(PROBE).trigger.interval.total_seconds() == 60.0


def fire_times(trigger: BaseTrigger, since: datetime, until: datetime) -> list[datetime]:
    """Return the times APScheduler fires `trigger` in [since, until] (its next_run_times)."""
    out: list[datetime] = []
    at = trigger.get_next_fire_time(None, since)
    while at is not None and at <= until:
        out.append(at)
        at = trigger.get_next_fire_time(at, at)
    return out


@pytest.mark.parametrize("probe_interval_s", [60.0, 10.0])  # shipped; the live run
def test_housekeeping_never_fires_with_a_probe_cycle(probe_interval_s: float) -> None:
    s = settings(probe_interval_s=probe_interval_s)
    js = build_scheduler(s, {n: noop for n in (PROBE, BURST, TRAFFIC_FLUSH, MEMORY_TRIM)},
                         AlwaysLeader())
    trig = {job.id: job.trigger for job in js.aps.get_jobs()}
    since = min(t.start_date for t in trig.values())
    until = since + timedelta(seconds=3 * s.scheduler.burst_interval_s)
    fires = {name: fire_times(t, since, until) for name, t in trig.items()}
    assert all(len(times) >= 2 for times in fires.values())

    def gap_s(name: str, other: str) -> float:
        return min(abs((a - b).total_seconds()) for a in fires[name] for b in fires[other])

    margin = probe_interval_s / 10
    for name in (BURST, TRAFFIC_FLUSH, MEMORY_TRIM):
        assert gap_s(name, PROBE) >= margin, name
    assert min(gap_s(BURST, TRAFFIC_FLUSH), gap_s(BURST, MEMORY_TRIM),
               gap_s(MEMORY_TRIM, TRAFFIC_FLUSH)) >= margin


def test_probes_disabled_leaves_probe_jobs_out() -> None:
    js = build_scheduler(settings(probes_enabled=False), {PROBE: noop, EVALUATE: noop},
                         AlwaysLeader())
    assert js.jobs() == [EVALUATE]


@pytest.mark.parametrize(("override", "field"), [
    ({"report_cron": "not a cron"}, "scheduler.report_cron"),
    ({"evaluate_interval_s": 0}, "scheduler.evaluate_interval_s")])
def test_bad_schedule_names_the_field(override: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build_scheduler(settings(**override), {EVALUATE: noop}, AlwaysLeader())


def test_unknown_job_name_is_refused() -> None:
    with pytest.raises(ValueError, match="jobs: unknown job 'evaluation'"):
        build_scheduler(settings(), {"evaluation": noop}, AlwaysLeader())


def test_overlapping_triggers_run_once() -> None:
    running = 0
    peak = 0
    started = threading.Event()
    release = threading.Event()
    lock = threading.Lock()

    def slow_probe() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        started.set()
        release.wait(5)
        with lock:
            running -= 1

    js = build_scheduler(settings(probe_interval_s=0.02), {PROBE: slow_probe}, AlwaysLeader())
    skipped = threading.Semaphore(0)
    js.aps.add_listener(lambda _event: skipped.release(), EVENT_JOB_MAX_INSTANCES)
    js.start()
    try:
        assert started.wait(5)
        for _ in range(3):  # triggers that fired while the first run was still going
            assert skipped.acquire(timeout=5)
        assert js.stats()[PROBE].running and js.stats()[PROBE].runs == 0
        assert js.activity()[PROBE] == (1, True)  # one run started, running now
        release.set()
        wait_for(lambda: js.stats()[PROBE].runs >= 2)
    finally:
        release.set()
        js.shutdown()
    assert peak == 1


def test_singletons_skip_on_a_follower_and_failures_are_counted() -> None:
    calls = {"evaluate": 0, "flush": 0}

    def evaluate() -> None:
        calls["evaluate"] += 1

    def flush() -> None:
        calls["flush"] += 1
        raise ConnectionError("database down")

    js = build_scheduler(settings(evaluate_interval_s=0.02, traffic_flush_interval_s=0.02),
                         {EVALUATE: evaluate, TRAFFIC_FLUSH: flush}, NotLeader())
    js.start()
    try:
        wait_for(lambda: js.stats()[TRAFFIC_FLUSH].failures >= 2
                 and js.stats()[EVALUATE].not_leader >= 2)
    finally:
        js.shutdown()
    assert calls["evaluate"] == 0 and calls["flush"] >= 2
    assert js.stats()[TRAFFIC_FLUSH].last_error == "ConnectionError: database down"


def test_sqlite_gets_an_always_leader() -> None:
    engine = make_engine("sqlite://")
    assert isinstance(make_leader(engine), AlwaysLeader)
    with pytest.raises(ValueError, match="database_url"):
        PgAdvisoryLeader(engine)


def test_lock_key_is_a_stable_signed_bigint() -> None:
    assert lock_key("x") == lock_key("x") != lock_key("y")
    assert -(1 << 63) <= lock_key("tailwatch") < 1 << 63


@pytest.mark.postgres
def test_two_replicas_on_postgres_run_a_singleton_on_exactly_one(pg_url: str) -> None:
    name = f"test-leader-{time.monotonic_ns()}"
    engines = [make_engine(pg_url), make_engine(pg_url)]
    leaders = [PgAdvisoryLeader(e, name=name) for e in engines]
    runs = [0, 0]
    active: set[int] = set()
    overlap: list[set[int]] = []
    lock = threading.Lock()

    def evaluate(i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                active.add(i)
                if len(active) > 1:
                    overlap.append(set(active))
            time.sleep(0.01)
            with lock:
                active.discard(i)
                runs[i] += 1
        return run

    s = settings(evaluate_interval_s=0.05)
    reps = [build_scheduler(s, {EVALUATE: evaluate(i)}, leaders[i]) for i in (0, 1)]
    try:
        reps[0].start()
        wait_for(lambda: runs[0] >= 2)
        reps[1].start()
        wait_for(lambda: reps[1].stats()[EVALUATE].not_leader >= 3)
        assert runs[1] == 0
        with engines[0].connect() as conn:  # the lock is visible to PostgreSQL itself
            held = conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                     " AND granted")).scalar()
        assert held >= 1
        reps[0].shutdown()  # releases the advisory lock
        frozen = runs[0]
        wait_for(lambda: runs[1] >= 2)
        assert runs[0] == frozen
    finally:
        for r in reps:
            r.shutdown()
        for e in engines:
            e.dispose()
    assert overlap == []


@pytest.mark.postgres
def test_leader_connection_loss_hands_over(pg_url: str) -> None:
    name = f"test-handover-{time.monotonic_ns()}"
    engines = [make_engine(pg_url), make_engine(pg_url)]
    a, b = (PgAdvisoryLeader(e, name=name) for e in engines)
    try:
        assert a.is_leader() and not b.is_leader()
        with engines[1].connect() as conn:  # kill a's session as a crash or failover would
            pid = a._conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        wait_for(b.is_leader, timeout_s=5)
        assert not a.is_leader()
    finally:
        a.release()
        b.release()
        for e in engines:
            e.dispose()


def test_job_metrics_and_activity_follow_each_run() -> None:
    registry = CollectorRegistry()
    fail = threading.Event()
    runs = threading.Semaphore(0)

    def flush() -> None:
        runs.release()
        if fail.is_set():
            raise ConnectionError("database down")

    js = build_scheduler(settings(traffic_flush_interval_s=0.02, evaluate_interval_s=3600),
                         {TRAFFIC_FLUSH: flush, EVALUATE: noop}, NotLeader(),
                         metrics=JobMetrics(registry))
    get = registry.get_sample_value
    # Series exist before any run: a job that never ran still shows on the dashboard.
    assert get("tailwatch_job_duration_seconds_count", {"scheduled_job": EVALUATE}) == 0
    assert get("tailwatch_job_failures_total", {"scheduled_job": TRAFFIC_FLUSH}) == 0
    assert js.activity() == {TRAFFIC_FLUSH: (0, False), EVALUATE: (0, False)}
    js.start()
    try:
        wait_for(lambda: js.stats()[TRAFFIC_FLUSH].runs >= 2)
        fail.set()
        wait_for(lambda: js.stats()[TRAFFIC_FLUSH].failures >= 1)
    finally:
        js.shutdown()
    stats = js.stats()[TRAFFIC_FLUSH]
    started, running = js.activity()[TRAFFIC_FLUSH]
    assert started == stats.runs and not running
    # Unregistered at shutdown: a stopped scheduler's jobs no longer run.
    assert get("tailwatch_job_duration_seconds_count", {"scheduled_job": TRAFFIC_FLUSH}) is None
    (row,) = [r for r in job_table(js.stats()) if r["name"] == TRAFFIC_FLUSH]
    assert row["runs"] == stats.runs and row["failures"] == stats.failures >= 1
    assert row["last_success"] is not None and row["leader"] is None  # every replica's job
    assert stats.last_duration_s is not None and stats.last_duration_s >= 0


def test_job_metrics_count_runs_failures_and_last_success() -> None:
    registry = CollectorRegistry()
    outcomes = iter([None, ConnectionError("down"), None])

    def flush() -> None:
        outcome = next(outcomes, None)
        if outcome is not None:
            raise outcome

    js = build_scheduler(settings(traffic_flush_interval_s=0.02), {TRAFFIC_FLUSH: flush},
                         AlwaysLeader(), metrics=JobMetrics(registry))
    get = registry.get_sample_value
    seen: list[tuple[float | None, float | None, float | None]] = []
    js.start()
    try:
        wait_for(lambda: js.stats()[TRAFFIC_FLUSH].runs >= 3)
        key = {"scheduled_job": TRAFFIC_FLUSH}
        seen.append((get("tailwatch_job_duration_seconds_count", key),
                     get("tailwatch_job_failures_total", key),
                     get("tailwatch_job_last_success_timestamp_seconds", key)))
    finally:
        js.shutdown()
    (count, failures, last_success), = seen
    assert count is not None and count >= 3
    assert failures == 1
    assert last_success is not None and last_success > 0


def test_a_singletons_leader_state_is_in_the_table() -> None:
    js = build_scheduler(settings(evaluate_interval_s=0.02), {EVALUATE: noop}, NotLeader())
    js.start()
    try:
        wait_for(lambda: js.stats()[EVALUATE].not_leader >= 1)
    finally:
        js.shutdown()
    (row,) = job_table(js.stats())
    assert row["leader"] is False and row["runs"] == 0 and row["singleton"] is True


def test_wait_idle_waits_for_a_run_in_flight_after_shutdown() -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(10)

    js = build_scheduler(settings(traffic_flush_interval_s=0.02), {TRAFFIC_FLUSH: slow},
                         AlwaysLeader())
    js.start()
    assert started.wait(5)
    js.shutdown(wait=False)  # what the lifespan does: no new runs, the current one goes on
    assert not js.wait_idle(0.05)
    release.set()
    assert js.wait_idle(10) and not js.stats()[TRAFFIC_FLUSH].running
