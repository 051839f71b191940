"""The SQLite file lock leader: one process of many leads; a stopped or killed one hands over."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from monitor.leader import AlwaysLeader, FileLockLeader, lock_file, make_leader
from monitor.loopback import wait_for
from storage.db import make_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return lock_file(tmp_path / "tailwatch.db")


@pytest.fixture
def leaders(lock_path: Path) -> Iterator[tuple[FileLockLeader, FileLockLeader]]:
    # Two opens of one file conflict under flock even in one process: as two workers do.
    a, b = FileLockLeader(lock_path), FileLockLeader(lock_path)
    try:
        yield a, b
    finally:
        a.release()
        b.release()


def test_one_of_two_leads_and_the_other_takes_over_after_release(
        leaders: tuple[FileLockLeader, FileLockLeader], lock_path: Path) -> None:
    a, b = leaders
    assert a.is_leader() and not b.is_leader()
    assert a.is_leader() and not b.is_leader()  # the leader keeps it; checks do not steal it
    assert lock_path.read_text().strip() == str(os.getpid())
    a.release()
    a.release()  # idempotent
    assert b.is_leader()
    assert not a.is_leader()  # a released leader never leads again, even with the lock free
    b.release()
    assert not a.is_leader() and not b.is_leader()


def test_waiting_is_logged_once_and_leading_once(
        leaders: tuple[FileLockLeader, FileLockLeader],
        caplog: pytest.LogCaptureFixture) -> None:
    a, b = leaders
    with caplog.at_level(logging.DEBUG, logger="monitor.leader"):
        for _ in range(3):
            assert a.is_leader() and not b.is_leader()
        a.release()
        assert b.is_leader() and b.is_leader()
    lines = [r.getMessage() for r in caplog.records]
    waiting = [m for m in lines if "another process leads" in m]
    assert waiting == [f"another process leads the scheduler (pid {os.getpid()}, lock file "
                       f"{a.path}); this one takes over when it stops"]
    assert sum("became scheduler leader" in m for m in lines) == 2  # a, then b


def test_a_killed_leader_process_hands_over(lock_path: Path) -> None:
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from monitor.leader import FileLockLeader\n"
            f"assert FileLockLeader(Path({str(lock_path)!r})).is_leader()\n"
            "print('leading', flush=True)\n"
            "time.sleep(600)\n")
    ours = FileLockLeader(lock_path)
    with subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "leading\n"
            assert not ours.is_leader()
            proc.send_signal(signal.SIGKILL)  # no release runs: only the kernel frees the lock
            proc.wait(60.0)
            wait_for(ours.is_leader, timeout_s=5)
        finally:
            ours.release()
            if proc.poll() is None:
                proc.kill()

def test_an_unopenable_lock_file_does_not_lead_and_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    leader = FileLockLeader(tmp_path / "missing" / "tailwatch.db.leader")
    with caplog.at_level(logging.WARNING, logger="monitor.leader"):
        assert not leader.is_leader() and not leader.is_leader()
    assert len(caplog.records) == 1
    assert "cannot open the leader lock file" in caplog.records[0].getMessage()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?uri=true"])
def test_in_memory_sqlite_gets_an_always_leader(url: str) -> None:
    engine = make_engine(url)
    try:
        assert isinstance(make_leader(engine), AlwaysLeader)
    finally:
        engine.dispose()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock on Windows")
def test_a_sqlite_file_gets_a_lock_file_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative URL is resolved once, at start
    engine = make_engine("sqlite:///./var/tailwatch.db")
    try:
        leader = make_leader(engine)
    finally:
        engine.dispose()
    assert isinstance(leader, FileLockLeader)
    assert leader.path == tmp_path / "var" / "tailwatch.db.leader"
