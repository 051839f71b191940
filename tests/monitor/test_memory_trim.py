"""The memory_trim job: `serve` and its worker each hand glibc's free heap pages back."""

from __future__ import annotations

import ctypes
import platform
import sys
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine import malloc
from monitor.app import create_app
from monitor.cli import main
from monitor.hub import services_of
from monitor.leader import AlwaysLeader
from monitor.scheduler import MEMORY_TRIM, build_scheduler
from monitor.settings import Settings
from monitor.worker import AnalysisWorker, WorkerSeams
from tests.engine.test_malloc import arenas
from tests.monitor.conftest import make_settings, suites, wait_for
from tests.monitor.fakes import FakeFactory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
FAST_TRIM = {"memory_trim_interval_s": 0.2}


class Trims:
    """Counts the job's calls in place of glibc's malloc_trim."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return True


def test_the_trim_job_follows_its_setting() -> None:
    on = build_scheduler(Settings(scheduler={"memory_trim_interval_s": 30}),
                         {MEMORY_TRIM: Trims()}, AlwaysLeader())
    assert on.aps.get_job(MEMORY_TRIM).trigger.interval.total_seconds() == 30
    off = build_scheduler(Settings(scheduler={"memory_trim_interval_s": 0}),
                          {MEMORY_TRIM: Trims()}, AlwaysLeader())
    assert off.aps.get_job(MEMORY_TRIM) is None


def test_a_negative_trim_interval_is_one_line_naming_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    monkeypatch.setenv("TAILWATCH_SCHEDULER__MEMORY_TRIM_INTERVAL_S", "-5")
    assert main(["config", "show"]) == 1
    assert capsys.readouterr().err.strip() == (
        "Error: invalid settings: scheduler.memory_trim_interval_s: Input should be greater "
        "than or equal to 0")


def test_the_serving_process_trims_its_heap_as_a_timed_job(migrated_url: str) -> None:
    trims = Trims()
    app = create_app(make_settings(migrated_url, scheduler={
                         "enabled": True, "probes_enabled": False, **FAST_TRIM}),
                     engine_factory=FakeFactory(), registry=CollectorRegistry(),
                     suites=suites(), trim_heap=trims, analysis_in_process=False)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        label = {"scheduled_job": MEMORY_TRIM}
        get = services_of(app).metrics.registry.get_sample_value
        wait_for(lambda: (get("tailwatch_job_duration_seconds_count", label) or 0) >= 2)
        assert trims.calls >= 2 and get("tailwatch_job_failures_total", label) == 0


def test_the_worker_trims_its_heap_as_a_timed_job(migrated_url: str) -> None:
    trims = Trims()
    settings = make_settings(migrated_url, worker={"port": 0}, scheduler={
        "enabled": True, "evaluate_interval_s": 3600, **FAST_TRIM})
    worker = AnalysisWorker(settings, seams=WorkerSeams(trim_heap=trims))
    worker.start()
    try:
        label = {"scheduled_job": MEMORY_TRIM}
        wait_for(lambda: (worker.registry.get_sample_value(
            "tailwatch_job_duration_seconds_count", label) or 0) >= 2)
        assert trims.calls >= 2
    finally:
        worker.close()
    done = trims.calls
    time.sleep(0.5)
    assert trims.calls == done  # stopped with the worker


def test_production_wiring_trims_with_glibc() -> None:
    assert create_app(make_settings("sqlite://")).state.parts.seams.trim_heap is malloc.trim
    assert WorkerSeams().trim_heap is malloc.trim


@glibc
def test_a_trim_returns_freed_heap_pages_that_no_heap_shrink_reaches() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # 32 MiB in blocks under glibc's mmap threshold land in the heap; freed below a block
    # still in use, the heap cannot shrink from its top: only a trim returns the pages.
    blocks = [libc.malloc(64 * 1024) for _ in range(512)]
    pin = libc.malloc(64 * 1024)
    for b in blocks:
        libc.free(b)
    assert malloc.trim() is True
    libc.free(pin)


@pytest.fixture
def uncached_glibc() -> Iterator[None]:
    # engine.malloc looks glibc's functions up once per process: a test that changes what
    # the lookup finds starts from an empty cache and leaves one behind for the next.
    malloc._glibc.cache_clear()
    yield
    malloc._glibc.cache_clear()


def test_without_glibc_a_trim_does_nothing(monkeypatch: pytest.MonkeyPatch,
                                           uncached_glibc: None) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert malloc.trim() is False
    malloc._glibc.cache_clear()
    monkeypatch.setattr(sys, "platform", "linux")

    def no_library(*args: object, **kwargs: object) -> object:
        raise OSError("libc.so.6: cannot open shared object file")  # musl

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert malloc.trim() is False


@glibc
def test_the_worker_process_caps_its_arenas_too() -> None:
    # The worker never loads torch, but its modules import the engine package, whose
    # import caps glibc's arenas (engine.malloc): the trim then walks two arenas, not 16.
    assert arenas("monitor.worker") <= 2
