"""`serve`'s worker: start `tailwatch worker` as a child, restart it when it dies, stop it.

The child reads its stdin from a pipe only this process writes to: when `serve` exits,
however it exits, the pipe closes and the worker stops (`monitor.parent_watch`). When the
worker dies, it is logged and started again after a backoff (1 s, doubling up to
`worker.restart_backoff_max_s`; back to 1 s after a run that lasted longer than that).
`view()` is what `serve`'s /readyz reports of its worker.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import IO

import httpx

from monitor.settings import Settings
from vocab import utcnow

log = logging.getLogger(__name__)

STOP_WAIT_S = 15.0  # a running evaluation finishes before the worker exits
# /readyz asks the worker for its job table but never waits on it for long: a worker busy
# or hung must not make the serving process's readiness answer late.
HEALTH_TIMEOUT_S = 0.5


def worker_command(config_file: str | None) -> list[str]:
    """Return the command line of `serve`'s worker."""
    config = ["--config", config_file] if config_file else []
    return [sys.executable, "-m", "monitor.cli", *config, "worker", "--exit-with-parent"]


def health_url(host: str, port: int) -> str | None:
    """Return where a worker bound to host:port answers /healthz (None for port 0: any)."""
    if port == 0:
        return None
    # A worker listening on every address answers on loopback.
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/healthz" if ":" in host else f"http://{host}:{port}/healthz"


def worker_env(settings: Settings) -> dict[str, str]:
    """Return the worker's environment: this one plus the API address `serve` overrode.

    Alerts name the service by api.host:api.port, which `serve --host/--port` may set.
    """
    return {**os.environ, "TAILWATCH_API__HOST": settings.api.host,
            "TAILWATCH_API__PORT": str(settings.api.port)}


class WorkerSupervisor:
    """Keep one worker child running until `stop()`.

    Example:
        sup = WorkerSupervisor(worker_command(None), worker_env(settings), backoff_max_s=60)
        sup.start()
        ...
        sup.stop()      # closes its stdin, waits, then terminates and kills
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], *,
                 backoff_max_s: float = 60.0, output: IO[bytes] | None = None,
                 health_url: str | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self._command = list(command)
        self._env = dict(env)
        self._output = output  # the child's stdout and stderr (None: this process's)
        self._backoff_max_s = backoff_max_s
        self._health_url = health_url  # the worker's /healthz (None: not asked)
        self._clock = clock
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.restarts = 0
        self._last_exit: dict[str, object] | None = None

    @property
    def pid(self) -> int | None:
        """Return the running worker's pid (None between runs)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> None:
        """Start the worker and the thread that restarts it."""
        self._spawn()
        self._thread = threading.Thread(target=self._watch, name="tailwatch-worker-watch",
                                        daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            # Its own session: a terminal's Ctrl-C reaches `serve` alone, which then stops
            # the worker (else both stop at once and the worker's exit reads as a crash).
            self._proc = subprocess.Popen(
                self._command, env=self._env, stdin=subprocess.PIPE, stdout=self._output,
                stderr=subprocess.STDOUT if self._output is not None else None,
                start_new_session=True)
        log.info("tailwatch: started the analysis worker (pid %d)", self._proc.pid)

    def _watch(self) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            started = time.monotonic()
            code = proc.wait()
            if self._stopping.is_set():
                return
            with self._lock:
                self._last_exit = {"pid": proc.pid, "code": code, "at": self._clock().isoformat(),
                                   "ran_s": round(time.monotonic() - started, 3)}
            if time.monotonic() - started > self._backoff_max_s:
                backoff = 1.0
            log.error("tailwatch: the analysis worker (pid %d) exited with code %d; "
                      "restarting it in %.0f s", proc.pid, code, backoff)
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self._backoff_max_s)
            self.restarts += 1
            self._spawn()

    def view(self) -> dict[str, object]:
        """Return the worker as this process sees it, and its own /healthz when it answers.

        pid (None between runs), alive, restarts so far, last_exit (pid, code, at, ran_s;
        None before any), health: the worker's /healthz body (status, pid, jobs), or
        status "unreachable" with the error (starting, hung, crashed), or None while no
        worker runs or its address is unknown.
        """
        pid = self.pid
        with self._lock:
            last_exit = dict(self._last_exit) if self._last_exit is not None else None
        health = self._health() if pid is not None and self._health_url else None
        return {"pid": pid, "alive": pid is not None, "restarts": self.restarts,
                "last_exit": last_exit, "health": health}

    def _health(self) -> dict[str, object]:
        assert self._health_url is not None
        try:
            # trust_env=False: loopback, never through a proxy from the environment.
            r = httpx.get(self._health_url, timeout=HEALTH_TIMEOUT_S, trust_env=False)
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            return {"status": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
        if not isinstance(body, dict):
            return {"status": "unreachable", "error": f"unexpected answer: {str(body)[:80]}"}
        return body

    def stop(self) -> int | None:
        """Stop the worker (stdin closed, then SIGTERM, then SIGKILL); return its exit code."""
        with self._lock:
            self._stopping.set()
            proc = self._proc
        if proc is None:
            return None
        if proc.stdin is not None:
            proc.stdin.close()  # the worker sees end-of-file and shuts down
        for step in (proc.terminate, proc.kill):
            try:
                return proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tailwatch: the analysis worker did not stop; %s", step.__name__)
                step()
        return proc.wait()
