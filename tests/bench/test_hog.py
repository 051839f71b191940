"""bench.hog: the CPU hog runs pinned to the CPU set it is given and never outlives the bench."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.hog import ROOT, Hog, parse_cpus
from monitor.loopback import wait_for


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(("busy_ms", "period_ms"), [(100.0, 100.0), (30.0, 100.0)])
def test_the_hog_spins_on_the_services_cpu_set_until_stopped(busy_ms: float,
                                                              period_ms: float) -> None:
    cpus = {max(os.sched_getaffinity(0))}
    # Stands in for the service: the hog takes the CPU set of another process.
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.sched_setaffinity(service.pid, cpus)
        with Hog(os.sched_getaffinity(service.pid), busy_ms=busy_ms,
                 period_ms=period_ms) as hog:
            pid = hog.pid
            assert os.sched_getaffinity(pid) == cpus
            proc = psutil.Process(pid)
            assert proc.cmdline()[1:3] == ["-m", "bench.hog"]
            # It is spinning (start() returned once it was about to): its CPU time grows.
            began = sum(proc.cpu_times()[:2])
            wait_for(lambda: sum(proc.cpu_times()[:2]) > began + 0.05, 60.0, interval_s=0.05,
                     what="the hog's CPU time")
            assert os.sched_getaffinity(pid) == cpus  # its own pinning agrees
        assert hog.returncode == 0  # SIGTERM: a clean exit
        assert _gone(pid)
    finally:
        service.kill()
        service.wait()


def test_the_hog_exits_when_the_bench_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "hog.pid"
    bench = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time; from bench.hog import Hog; "
         "h = Hog(os.sched_getaffinity(0)); h.start(); "
         f"open({str(pid_file)!r}, 'w').write(str(h.pid)); time.sleep(600)"],
        cwd=ROOT)
    try:
        wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 60.0, interval_s=0.05,
                 what="the hog's pid")
        pid = int(pid_file.read_text())
        assert psutil.pid_exists(pid)
        bench.send_signal(signal.SIGKILL)  # no cleanup runs in the bench
        bench.wait()
        wait_for(lambda: _gone(pid), 60.0, interval_s=0.05, what="the orphaned hog's exit")
    finally:
        bench.kill()
        bench.wait()


def test_a_hog_refuses_an_empty_cpu_set_or_a_duty_over_its_period() -> None:
    with pytest.raises(ValueError, match="cpus"):
        Hog(set())
    with pytest.raises(ValueError, match="busy_ms"):
        Hog({0}, busy_ms=150.0, period_ms=100.0)
    assert parse_cpus("0,2-4") == {0, 2, 3, 4}
