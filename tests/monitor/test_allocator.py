"""glibc malloc of `serve` and `worker`: arena cap and mmap threshold at start, the trim job."""

from __future__ import annotations

import ctypes
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from monitor.allocator import M_ARENA_MAX, M_MMAP_THRESHOLD, Allocator, MemorySettings, glibc
from monitor.app import create_app
from monitor.cli import cli, main
from monitor.hub import services_of
from monitor.leader import AlwaysLeader
from monitor.scheduler import MEMORY_TRIM, build_scheduler
from monitor.settings import Settings
from monitor.worker import AnalysisWorker, WorkerSeams
from tests.monitor.conftest import TOKEN, make_settings, suites, wait_for
from tests.monitor.fakes import FakeFactory

GLIBC = glibc() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc malloc only")


class RecordingLibc:
    """A C library that records its malloc calls; `accepts` is what mallopt answers."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.mallopt_calls: list[tuple[int, int]] = []
        self.trims = 0

    def mallopt(self, param: int, value: int) -> int:
        self.mallopt_calls.append((param, value))
        return 1 if self.accepts else 0

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


class RecordingAllocator(Allocator):
    """The real Allocator over a recording libc: what `serve` and `worker` asked for."""

    def __init__(self) -> None:
        self.recording = RecordingLibc()
        super().__init__(self.recording)
        self.configured: list[MemorySettings] = []

    def configure(self, settings: MemorySettings) -> dict[str, int]:
        self.configured.append(settings)
        return super().configure(settings)


# --- the allocator itself ----------------------------------------------------------------

def test_settings_become_mallopt_calls_and_the_refused_ones_are_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    libc = RecordingLibc()
    applied = Allocator(libc).configure(MemorySettings(arena_max=2, mmap_threshold_bytes=1 << 20))
    assert libc.mallopt_calls == [(M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 1 << 20)]
    assert applied == {"arena_max": 2, "mmap_threshold_bytes": 1 << 20}
    # 0 and None keep glibc's own behaviour: nothing is called.
    assert Allocator(libc).configure(MemorySettings(arena_max=0)) == {}
    assert len(libc.mallopt_calls) == 2
    refusing = RecordingLibc(accepts=False)
    assert Allocator(refusing).configure(MemorySettings(arena_max=4)) == {}
    assert "memory.arena_max: glibc refused 4" in caplog.text


def test_without_glibc_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    none = Allocator(None)
    assert not none.available
    assert none.configure(MemorySettings(arena_max=2, mmap_threshold_bytes=1 << 20)) == {}
    assert none.trim() is False and none.usage() is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert glibc() is None and not Allocator.load().available


def test_a_c_library_without_glibcs_calls_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    class Musl:  # mallopt is a stub there; malloc_trim and gnu_get_libc_version are absent
        def mallopt(self, param: int, value: int) -> int:
            return 0

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Musl())
    assert glibc() is None

    def missing(*a: Any, **k: Any) -> Any:
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert glibc() is None


@needs_glibc
def test_glibc_accepts_the_shipped_settings_and_trims_freed_memory() -> None:
    allocator = Allocator.load()
    assert allocator.available
    shipped = MemorySettings()
    assert allocator.configure(shipped) == {"arena_max": shipped.arena_max}
    assert allocator.configure(MemorySettings(arena_max=0, mmap_threshold_bytes=4 << 20)) == \
        {"mmap_threshold_bytes": 4 << 20}
    libc = allocator.libc
    assert libc is not None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # 32 MiB in blocks under the mmap threshold land in the heap; freed with a block kept
    # above them, the heap cannot shrink from its top: only a trim returns those pages.
    blocks = [libc.malloc(64 * 1024) for _ in range(512)]
    pin = libc.malloc(64 * 1024)
    before = allocator.usage()
    for b in blocks:
        libc.free(b)
    after = allocator.usage()
    assert before is not None and after is not None
    assert after.free - before.free >= 30 * 1024 * 1024
    assert allocator.trim() is True
    libc.free(pin)


def test_memory_settings_errors_are_one_line_naming_the_field(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("TAILWATCH_CONFIG", "TAILWATCH_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    cases = {"ARENA_MAX": ("-1", "memory.arena_max: Input should be greater than or equal to 0"),
             "MMAP_THRESHOLD_BYTES": (str(64 << 20), "memory.mmap_threshold_bytes: Input "
                                                     "should be less than or equal to 33554432"),
             "TRIM_INTERVAL_S": ("-5", "memory.trim_interval_s: Input should be greater than "
                                       "or equal to 0")}
    for key, (value, message) in cases.items():
        monkeypatch.setenv(f"TAILWATCH_MEMORY__{key}", value)
        assert main(["config", "show"]) == 1
        err = capsys.readouterr().err
        assert err.strip() == f"Error: invalid settings: {message}", err
        monkeypatch.delenv(f"TAILWATCH_MEMORY__{key}")


# --- where serve and worker apply it -----------------------------------------------------

def _run_cli(args: list[str], allocator: Allocator) -> None:
    with pytest.raises(Exception):  # noqa: B017  each command stops at a later check
        cli.main(args=args, prog_name="tailwatch", standalone_mode=False,
                 obj={"allocator": allocator})


def test_serve_applies_the_memory_settings_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, sqlite_url: str) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("tailwatch serve started a server")

    monkeypatch.setattr("uvicorn.run", refuse)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("TAILWATCH_MEMORY__ARENA_MAX", "3")
    monkeypatch.setenv("TAILWATCH_MEMORY__MMAP_THRESHOLD_BYTES", str(1 << 20))
    allocator = RecordingAllocator()
    with socket.socket() as taken:  # serve stops at its port check, after the allocator
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _run_cli(["serve", "--port", str(taken.getsockname()[1])], allocator)
    assert allocator.configured == [MemorySettings(arena_max=3, mmap_threshold_bytes=1 << 20)]
    assert allocator.recording.mallopt_calls == [(M_ARENA_MAX, 3), (M_MMAP_THRESHOLD, 1 << 20)]


def test_worker_applies_the_memory_settings_at_start(monkeypatch: pytest.MonkeyPatch,
                                                     sqlite_url: str) -> None:
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("TAILWATCH_MEMORY__ARENA_MAX", "1")
    # The worker stops at "nothing to run", after the allocator.
    monkeypatch.setenv("TAILWATCH_SCHEDULER__ENABLED", "false")
    allocator = RecordingAllocator()
    _run_cli(["worker"], allocator)
    assert allocator.recording.mallopt_calls == [(M_ARENA_MAX, 1)]


# --- the trim job ------------------------------------------------------------------------

def test_the_trim_job_follows_its_setting() -> None:
    allocator = Allocator(RecordingLibc())
    on = build_scheduler(Settings(memory={"trim_interval_s": 30}), {MEMORY_TRIM: allocator.trim},
                         AlwaysLeader())
    assert on.aps.get_job(MEMORY_TRIM).trigger.interval.total_seconds() == 30
    off = build_scheduler(Settings(memory={"trim_interval_s": 0}), {MEMORY_TRIM: allocator.trim},
                          AlwaysLeader())
    assert off.aps.get_job(MEMORY_TRIM) is None


FAST_TRIM = {"trim_interval_s": 0.2}


def test_the_serving_process_trims_its_heap_as_a_timed_job(migrated_url: str) -> None:
    libc = RecordingLibc()
    allocator = Allocator(libc)
    app = create_app(make_settings(migrated_url, memory=FAST_TRIM,
                                   scheduler={"enabled": True, "probes_enabled": False}),
                     engine_factory=FakeFactory(), registry=CollectorRegistry(),
                     suites=suites(), allocator=allocator, analysis_in_process=False)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        wait_for(lambda: libc.trims >= 2)
        label = {"scheduled_job": MEMORY_TRIM}
        get = services_of(app).metrics.registry.get_sample_value
        wait_for(lambda: (get("tailwatch_job_duration_seconds_count", label) or 0) >= 2)
        assert get("tailwatch_job_failures_total", label) == 0


def test_the_worker_trims_its_heap_as_a_timed_job(migrated_url: str) -> None:
    libc = RecordingLibc()
    allocator = Allocator(libc)
    settings = make_settings(migrated_url, memory=FAST_TRIM, worker={"port": 0},
                             scheduler={"enabled": True, "evaluate_interval_s": 3600})
    worker = AnalysisWorker(settings, seams=WorkerSeams(allocator=allocator))
    worker.start()
    try:
        wait_for(lambda: libc.trims >= 2)
        label = {"scheduled_job": MEMORY_TRIM}
        wait_for(lambda: (worker.registry.get_sample_value(
            "tailwatch_job_duration_seconds_count", label) or 0) >= 2)
    finally:
        worker.close()
    done = libc.trims
    time.sleep(0.5)
    assert libc.trims == done  # stopped with the worker


def test_the_docs_name_the_memory_settings() -> None:
    ops = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    for key in MemorySettings.model_fields:
        assert f"memory.{key}" in ops
