"""`tailwatch serve` and its worker as real processes: started, restarted, never orphaned.

Every wait is on a process exit or an HTTP answer, each with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from monitor.loopback import free_port, wait_for
from monitor.supervisor import health_url
from tests.monitor.conftest import TOKEN

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
T = TypeVar("T")
pytestmark = pytest.mark.slow


@pytest.fixture
def db_kind() -> str:
    """SQLite: process supervision does not depend on the database."""
    return "sqlite"


def until(what: str, cond: Callable[[], T], timeout_s: float = DEADLINE_S) -> T:
    """Return cond()'s first truthy value; fail the test naming `what` after `timeout_s`."""
    try:
        return wait_for(cond, timeout_s, interval_s=0.05, what=what)
    except TimeoutError as e:
        pytest.fail(str(e))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) is gone for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def worker_pid(port: int) -> int | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0)
    except httpx.HTTPError:
        return None
    return int(r.json()["pid"]) if r.status_code == 200 else None


class Serve:
    """A `tailwatch serve` process on the fake engine, its worker on `worker_port`."""

    def __init__(self, url: str, tmp: Path, *args: str) -> None:
        self.api_port, self.worker_port = free_port(), free_port()
        env = {**os.environ, "TAILWATCH_DATABASE_URL": url, "TAILWATCH_API_TOKEN": TOKEN,
               "TAILWATCH_WORKER__PORT": str(self.worker_port),
               "TAILWATCH_WORKER__RESTART_BACKOFF_MAX_S": "1",
               "TAILWATCH_SCHEDULER__EVALUATE_INTERVAL_S": "0.5",
               "PYTHONPATH": str(ROOT)}
        env.pop("TAILWATCH_CONFIG", None)
        self.log = tmp / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.monitor.serve_driver", "serve", "--port",
                 str(self.api_port), "--no-probes", *args],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def worker(self) -> int:
        pid = until("the worker answers /healthz", lambda: worker_pid(self.worker_port))
        assert isinstance(pid, int)
        return pid

    def ready(self) -> None:
        until("serve answers /healthz", lambda: self._api_ok())

    def _api_ok(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.api_port}/healthz",
                             timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def readyz(self) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.api_port}/readyz", timeout=5.0)

    def worker_view(self, cond: Callable[[dict], object]) -> dict | None:
        """Return /readyz's `worker` details once `cond` holds for them (else None)."""
        try:
            view = self.readyz().json()["worker"]
        except httpx.HTTPError:
            return None
        return view if cond(view) else None


@pytest.fixture
def serve(migrated_url: str, tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    started: list[Serve] = []

    def start(*args: str) -> Serve:
        s = Serve(migrated_url, tmp_path, *args)
        started.append(s)
        return s

    yield start
    for s in started:  # never leave a process behind, whatever the test did
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(DEADLINE_S)


def test_sigterm_stops_serve_and_its_worker(serve: Callable[..., Serve]) -> None:
    s = serve()
    pid = s.worker()
    s.ready()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(DEADLINE_S)
    until("the worker exits with serve", lambda: not alive(pid))
    assert "started the analysis worker" in s.output()


def test_a_killed_serve_leaves_no_worker_behind(serve: Callable[..., Serve]) -> None:
    s = serve()
    pid = s.worker()
    s.proc.kill()  # no shutdown code runs: only the closed pipe tells the worker
    s.proc.wait(DEADLINE_S)
    until("the orphaned worker exits", lambda: not alive(pid))


def test_a_crashed_worker_is_logged_and_restarted(serve: Callable[..., Serve]) -> None:
    s = serve()
    first = s.worker()
    os.kill(first, signal.SIGKILL)
    second = until("a new worker answers", lambda: (p := worker_pid(s.worker_port)) != first
                   and p)
    assert isinstance(second, int) and second != first
    assert "exited with code -9; restarting it" in s.output()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(DEADLINE_S)
    until("the restarted worker exits with serve", lambda: not alive(second))


def test_no_worker_starts_none(serve: Callable[..., Serve]) -> None:
    s = serve("--no-worker")
    s.ready()
    assert worker_pid(s.worker_port) is None
    assert "analysis worker" not in s.output()
    # No worker to report, and its absence does not make the serving process unready.
    ready = until("serve is ready", lambda: (r := s.readyz()).status_code == 200 and r)
    assert isinstance(ready, httpx.Response) and ready.json()["worker"] is None
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(DEADLINE_S)


def test_the_worker_runs_evaluation_the_serving_process_does_not(
        serve: Callable[..., Serve]) -> None:
    s = serve()
    s.worker()
    s.ready()

    def evaluated() -> dict | None:
        try:  # a read that times out on a loaded host is asked again, as the others are
            body = httpx.get(f"http://127.0.0.1:{s.worker_port}/healthz", timeout=2.0).json()
        except httpx.HTTPError:
            return None
        rows = {j["name"]: j for j in body["jobs"]}
        return rows if rows.get("evaluate", {}).get("runs", 0) >= 1 else None

    rows = until("the worker evaluates", evaluated)
    assert isinstance(rows, dict)
    assert set(rows) == {"evaluate", "delivery", "retention", "report", "sensitivity",
                         "memory_trim"}
    assert rows["evaluate"]["leader"] is True and rows["evaluate"]["last_success"]
    ready = httpx.get(f"http://127.0.0.1:{s.api_port}/readyz", timeout=5.0).json()
    # --no-probes: the serving process keeps only the traffic flush and its heap trim.
    assert [j["name"] for j in ready["jobs"]] == ["memory_trim", "traffic_flush"]
    metrics = httpx.get(f"http://127.0.0.1:{s.worker_port}/metrics", timeout=5.0).text
    assert 'tailwatch_job_duration_seconds_count{scheduled_job="evaluate"}' in metrics
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(DEADLINE_S)


def test_readyz_details_the_worker_serve_supervises(serve: Callable[..., Serve]) -> None:
    s = serve()
    first = s.worker()
    s.ready()
    view = until("/readyz shows the worker's job table",
                 lambda: s.worker_view(lambda v: (v["health"] or {}).get("jobs")))
    assert isinstance(view, dict)
    assert (view["pid"], view["alive"], view["restarts"], view["last_exit"]) == (
        first, True, 0, None)
    assert view["health"]["pid"] == first and view["health"]["status"] == "ok"
    assert "evaluate" in {j["name"] for j in view["health"]["jobs"]}
    os.kill(first, signal.SIGKILL)
    view = until("/readyz shows the crash and the restart",
                 lambda: s.worker_view(lambda v: v["restarts"] >= 1 and v["alive"]))
    assert isinstance(view, dict) and view["pid"] != first
    assert (view["last_exit"]["pid"], view["last_exit"]["code"]) == (first, -9)
    # The worker never decides readiness: the serving process is ready all the same.
    until("serve is ready", lambda: s.readyz().status_code == 200)
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(DEADLINE_S)


def test_the_worker_is_asked_on_loopback_when_it_listens_everywhere() -> None:
    assert health_url("0.0.0.0", 8001) == "http://127.0.0.1:8001/healthz"
    assert health_url("::", 8001) == "http://[::1]:8001/healthz"
    assert health_url("10.0.0.5", 9000) == "http://10.0.0.5:9000/healthz"
    assert health_url("127.0.0.1", 0) is None  # any free port: serve cannot know which
