"""One prober composition: `tailwatch probe --once` checks outputs as the service does."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from monitor.cli import main
from monitor.leader import AlwaysLeader
from monitor.prober import SchedulerActivity, build_prober
from monitor.scheduler import BURST, PROBE, TRAFFIC_FLUSH, build_scheduler
from monitor.settings import Settings
from probes.prober import Prober
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import CanaryReference, OutputAgreement, ProbeRun
from storage.writer import Writer
from tests.probes.fakes import FakeEngine, placeholder_suites, use_placeholder_cli


@pytest.fixture
def db_kind() -> str:
    """SQLite: the CLI's composition is the same on both databases."""
    return "sqlite"


@pytest.fixture
def fresh_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    use_placeholder_cli(monkeypatch, tmp_path, url)
    upgrade(url)
    return url


def test_two_cli_cycles_store_references_and_agreements(fresh_url: str) -> None:
    assert main(["probe", "--once", "--no-ab"]) == 0
    assert main(["probe", "--once", "--no-ab"]) == 0
    db = make_engine(fresh_url)
    try:
        with make_sessionmaker(db)() as s:
            references = s.scalar(select(func.count()).select_from(CanaryReference))
            agreements = s.scalar(select(func.count()).select_from(OutputAgreement))
    finally:
        db.dispose()
    assert references and references > 0
    assert agreements and agreements > 0


@dataclass
class Scheduled:
    """A prober on SQLite whose jobs run through the production scheduler's wrappers."""

    activity: SchedulerActivity
    writer: Writer
    sessions: sessionmaker[Session]

    def run(self, job: str) -> None:
        """Run `job` as the scheduler does (its wrapper marks it running meanwhile)."""
        self.activity.scheduler.aps.get_job(job).func()

    def beside(self, *jobs: str) -> list[threading.Thread]:
        """Return threads running `jobs` through their wrappers (not started)."""
        return [threading.Thread(target=self.activity.scheduler.aps.get_job(j).func)
                for j in jobs]

    def jobs_during(self) -> list[tuple[str, list[str]]]:
        """Return each stored probe row's kind and the jobs it names, in order."""
        assert self.writer.flush(timeout=30)
        with self.sessions() as s:
            runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
        return [(r.kind, r.details["jobs_during"]) for r in runs]


@contextmanager
def scheduled(tmp_path: Path, probes: dict[str, Any],
              jobs: Callable[[Prober], dict[str, Callable[[], object]]]) -> Iterator[Scheduled]:
    """Yield the service's prober composition over a fresh SQLite database, with `jobs`
    (given the prober) scheduled by build_scheduler."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    writer = Writer(sessions)
    settings = Settings(database_url=url, quality={"enabled": False}, probes=probes)
    engine = FakeEngine()
    engine.warm_up()
    activity = SchedulerActivity()
    prober = build_prober(settings, engine, writer, sessions, suites=placeholder_suites(2),
                          activity=activity)
    activity.scheduler = build_scheduler(settings, jobs(prober), AlwaysLeader())
    try:
        yield Scheduled(activity, writer, sessions)
    finally:
        writer.close(timeout=5)
        db.dispose()


def test_a_cycle_records_the_scheduler_jobs_running_beside_it(tmp_path: Path) -> None:
    """The service's composition: the scheduler's activity reaches the stored probe row."""
    release, entered = threading.Event(), threading.Event()

    def flush() -> None:
        entered.set()
        release.wait(30)

    with scheduled(tmp_path, {"canaries_per_bucket": 1, "ab_share": 0.0},
                   lambda prober: {PROBE: lambda: prober.run_cycle(),
                                   TRAFFIC_FLUSH: flush}) as service:
        (flushing,) = service.beside(TRAFFIC_FLUSH)
        try:
            flushing.start()
            assert entered.wait(30)
            service.run(PROBE)  # the probe job itself is running too
            release.set()
            flushing.join(30)
            service.run(PROBE)
            assert service.jobs_during() == [("cycle", [TRAFFIC_FLUSH]), ("cycle", [])]
        finally:
            release.set()


def test_a_burst_records_the_jobs_beside_it_less_the_probe_jobs(tmp_path: Path) -> None:
    """A burst row names the jobs that ran beside it; its own job and a waiting cycle's are
    the probes themselves (one at a time), never listed."""
    release, entered = threading.Event(), threading.Semaphore(0)

    def held() -> None:  # a flush running, and a cycle waiting for the burst to end
        entered.release()
        release.wait(30)

    probes = {"burst_rate_per_s": 200.0, "burst_duration_s": 0.05, "burst_concurrency": 2,
              "burst_unbatched": False}
    with scheduled(tmp_path, probes,
                   lambda prober: {BURST: lambda: prober.run_burst(), PROBE: held,
                                   TRAFFIC_FLUSH: held}) as service:
        beside = service.beside(PROBE, TRAFFIC_FLUSH)
        try:
            for t in beside:
                t.start()
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
            service.run(BURST)  # the burst job itself is running too
            release.set()
            for t in beside:
                t.join(30)
            service.run(BURST)
            assert service.jobs_during() == [("burst", [TRAFFIC_FLUSH]), ("burst", [])]
        finally:
            release.set()
