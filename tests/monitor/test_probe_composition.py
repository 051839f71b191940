"""One prober composition: `tailwatch probe --once` checks outputs as the service does."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from monitor.cli import main
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import CanaryReference, OutputAgreement
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


def test_a_cycle_records_the_scheduler_jobs_running_beside_it(tmp_path: Path) -> None:
    """The service's composition: the scheduler's activity reaches the stored probe row."""
    import threading

    from monitor.leader import AlwaysLeader
    from monitor.prober import SchedulerActivity, build_prober
    from monitor.scheduler import PROBE, TRAFFIC_FLUSH, build_scheduler
    from monitor.settings import Settings
    from storage.models import ProbeRun
    from storage.writer import Writer

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    writer = Writer(sessions)
    settings = Settings(database_url=url, quality={"enabled": False},
                        probes={"canaries_per_bucket": 1, "ab_share": 0.0})
    engine = FakeEngine()
    engine.warm_up()
    release, entered = threading.Event(), threading.Event()

    def flush() -> None:
        entered.set()
        release.wait(30)

    activity = SchedulerActivity()
    prober = build_prober(settings, engine, writer, sessions, suites=placeholder_suites(2),
                          activity=activity)
    activity.scheduler = build_scheduler(
        settings, {PROBE: lambda: prober.run_cycle(), TRAFFIC_FLUSH: flush}, AlwaysLeader())
    flushing = threading.Thread(target=activity.scheduler.aps.get_job(TRAFFIC_FLUSH).func)
    try:
        flushing.start()
        assert entered.wait(30)
        # Run through the scheduler's own wrapper: the probe job itself is running too.
        activity.scheduler.aps.get_job(PROBE).func()
        release.set()
        flushing.join(30)
        activity.scheduler.aps.get_job(PROBE).func()
        assert writer.flush(timeout=30)
        with sessions() as s:
            runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
        assert [r.details["jobs_during"] for r in runs] == [[TRAFFIC_FLUSH], []]
    finally:
        release.set()
        writer.close(timeout=5)
        db.dispose()


def test_a_burst_records_the_jobs_beside_it_less_the_probe_jobs(tmp_path: Path) -> None:
    """A burst row names the jobs that ran beside it; its own job and a waiting cycle's are
    the probes themselves (one at a time), never listed."""
    import threading

    from monitor.leader import AlwaysLeader
    from monitor.prober import SchedulerActivity, build_prober
    from monitor.scheduler import BURST, PROBE, TRAFFIC_FLUSH, build_scheduler
    from monitor.settings import Settings
    from storage.models import ProbeRun
    from storage.writer import Writer

    url = f"sqlite:///{tmp_path / 'burst_jobs.db'}"
    upgrade(url)
    db = make_engine(url)
    sessions = make_sessionmaker(db)
    writer = Writer(sessions)
    settings = Settings(database_url=url, quality={"enabled": False},
                        probes={"burst_rate_per_s": 200.0, "burst_duration_s": 0.05,
                                "burst_concurrency": 2, "burst_unbatched": False})
    engine = FakeEngine()
    engine.warm_up()
    release, entered = threading.Event(), threading.Semaphore(0)

    def held() -> None:  # a flush running, and a cycle waiting for the burst to end
        entered.release()
        release.wait(30)

    activity = SchedulerActivity()
    prober = build_prober(settings, engine, writer, sessions, suites=placeholder_suites(2),
                          activity=activity)
    activity.scheduler = build_scheduler(
        settings, {BURST: lambda: prober.run_burst(), PROBE: held, TRAFFIC_FLUSH: held},
        AlwaysLeader())
    beside = [threading.Thread(target=activity.scheduler.aps.get_job(name).func)
              for name in (PROBE, TRAFFIC_FLUSH)]
    try:
        for t in beside:
            t.start()
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
        # Through the scheduler's own wrapper: the burst job itself is running too.
        activity.scheduler.aps.get_job(BURST).func()
        release.set()
        for t in beside:
            t.join(30)
        activity.scheduler.aps.get_job(BURST).func()
        assert writer.flush(timeout=30)
        with sessions() as s:
            runs = s.scalars(select(ProbeRun).order_by(ProbeRun.id)).all()
        assert [(r.kind, r.details["jobs_during"]) for r in runs] == [
            ("burst", [TRAFFIC_FLUSH]), ("burst", [])]
    finally:
        release.set()
        writer.close(timeout=5)
        db.dispose()
