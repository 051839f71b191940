"""`worker.nice`: the analysis jobs' threads yield the CPU; measurement jobs do not.

Nice values are read back from the kernel (`os.getpriority` on the thread, and
/proc/<pid>/task/<tid>/stat for a real `tailwatch worker` process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from monitor.cli import main
from monitor.loopback import free_port
from monitor.priority import THREAD_PREFIX, thread_nice
from monitor.scheduler import EVALUATE, PROBE, build_scheduler
from monitor.settings import Settings
from monitor.worker import AnalysisWorker, WorkerSeams
from tests.monitor.conftest import TOKEN, make_settings, wait_for
from vocab import utcnow

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="nice values per thread are Linux's")

ROOT = Path(__file__).resolve().parents[2]
FAST = {"enabled": True, "evaluate_interval_s": 0.2, "delivery_interval_s": 0.2}


@pytest.fixture
def db_kind() -> str:
    """SQLite: thread priority does not depend on the database."""
    return "sqlite"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TAILWATCH_") and not name.startswith("TAILWATCH_TEST_"):
            monkeypatch.delenv(name)


def test_worker_nice_defaults_to_10_and_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(database_url="sqlite://").worker.nice == 10
    monkeypatch.setenv("TAILWATCH_WORKER__NICE", "0")
    assert Settings(database_url="sqlite://").worker.nice == 0


@pytest.mark.parametrize("value", ["20", "-1", "high"])
def test_a_bad_worker_nice_is_one_line_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    config = tmp_path / "tailwatch.yaml"
    config.write_text(f"worker:\n  nice: {value}\n")
    code = main(["--config", str(config), "config", "show"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert len(err.splitlines()) == 1, err
    assert err.startswith("Error: invalid settings: worker.nice: "), err


def test_analysis_jobs_run_niced_and_measurement_jobs_do_not() -> None:
    base = thread_nice()
    seen: dict[str, set[int]] = {PROBE: set(), EVALUATE: set()}
    ran = {name: threading.Event() for name in seen}

    def job(name: str) -> Callable[[], None]:
        def run() -> None:
            seen[name].add(thread_nice())
            ran[name].set()
        return run

    settings = Settings(database_url="sqlite://", scheduler={
        "probe_interval_s": 0.05, "evaluate_interval_s": 0.05}, worker={"nice": 7})
    js = build_scheduler(settings, {PROBE: job(PROBE), EVALUATE: job(EVALUATE)},
                         _AlwaysLeader())
    js.start()
    try:
        assert all(e.wait(30) for e in ran.values())
    finally:
        js.shutdown(wait=True)
    assert seen[EVALUATE] == {max(base, 7)}
    assert seen[PROBE] == {base}
    assert thread_nice() == base  # the caller's thread, like the engine's, keeps its value


class _AlwaysLeader:
    def is_leader(self) -> bool:
        return True

    def release(self) -> None:
        pass


def test_the_worker_evaluates_on_threads_at_worker_nice(migrated_url: str) -> None:
    base = thread_nice()
    calls: list[tuple[str, int]] = []

    def clock() -> datetime:  # called by every job run, on the thread that runs it
        calls.append((threading.current_thread().name, thread_nice()))
        return utcnow()

    settings = make_settings(migrated_url, scheduler=FAST, worker={"port": 0, "nice": 9})
    worker = AnalysisWorker(settings, seams=WorkerSeams(clock=clock))
    worker.start()
    try:
        # Niced on a shared host: its runs may wait behind other users' work.
        wait_for(lambda: worker.scheduler is not None
                 and worker.scheduler.stats()[EVALUATE].runs >= 2, 120.0)
    finally:
        worker.close()
    in_jobs = {nice for name, nice in calls if name.startswith(THREAD_PREFIX)}
    assert in_jobs == {max(base, 9)}
    assert thread_nice() == base


def _nice_of(pid: int, tid: int) -> int:
    # Field 19 of /proc/<pid>/task/<tid>/stat; the command name (field 2) may hold spaces.
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def _evaluations(port: int) -> int:
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).json()
    except httpx.HTTPError:
        return 0
    return next((j["runs"] for j in body["jobs"] if j["name"] == EVALUATE), 0)


def test_tailwatch_worker_runs_its_evaluation_at_worker_nice(
        migrated_url: str, tmp_path: Path) -> None:
    base = thread_nice()
    port = free_port()
    env = {**os.environ, "TAILWATCH_DATABASE_URL": migrated_url, "TAILWATCH_API_TOKEN": TOKEN,
           "TAILWATCH_SCHEDULER__EVALUATE_INTERVAL_S": "0.2", "TAILWATCH_WORKER__NICE": "12",
           "PYTHONPATH": str(ROOT)}
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(  # in a session of its own, as `serve` starts it
            [sys.executable, "-m", "monitor.cli", "worker", "--port", str(port),
             "--exit-with-parent"], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or _evaluations(port) >= 1, 120.0,
                 interval_s=0.1, what="the worker's first evaluation")
        assert proc.poll() is None, log.read_text()
        nice = {tid: _nice_of(proc.pid, tid)
                for tid in map(int, os.listdir(f"/proc/{proc.pid}/task"))}
        group = _autogroup_nice(Path(f"/proc/{proc.pid}/autogroup"))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(60.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60.0)
    assert nice[proc.pid] == base, nice  # the main thread (and /healthz) keep theirs
    assert set(nice.values()) == {base, max(base, 12)}, nice  # the analysis threads: 12
    # Its session's autogroup yields to serve's as a whole (kernels with autogroups).
    assert group is None or group >= 12, group


def _autogroup_nice(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        # A kernel without autogroups, or a sandbox whose file reads empty.
        return None


SESSION_PROBE = ("from pathlib import Path; from monitor.priority import AUTOGROUP, "
                 "lower_session_priority as lower\n"
                 "print(lower(12), AUTOGROUP.read_text().split()[-1] if AUTOGROUP.exists() "
                 "else None)\n")


@pytest.mark.parametrize(("new_session", "lowered"), [(True, True), (False, False)])
def test_only_a_session_leader_lowers_its_autogroup(new_session: bool, lowered: bool) -> None:
    before = _autogroup_nice(Path("/proc/self/autogroup"))
    if before is None:
        pytest.skip("no readable /proc/self/autogroup (kernel or sandbox without autogroups)")
    out = subprocess.run([sys.executable, "-c", SESSION_PROBE], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)},
                         start_new_session=new_session).stdout.split()
    assert out[0] == str(lowered)
    # A child in this session shares this session's autogroup: left as it was.
    assert int(out[1]) == (12 if lowered else before)


@pytest.mark.parametrize("content", ["", "garbage\n"])
def test_an_unreadable_autogroup_leaves_the_session_as_it_is(tmp_path: Path, content: str) -> None:
    # Some sandboxes expose /proc/self/autogroup but read it empty: the worker must start.
    fake = tmp_path / "autogroup"
    fake.write_text(content)
    probe = ("from pathlib import Path; from monitor.priority import lower_session_priority\n"
             f"print(lower_session_priority(12, Path({str(fake)!r})))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)},
                         start_new_session=True).stdout.split()
    assert out == ["False"]
    assert fake.read_text() == content
