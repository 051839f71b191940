"""`serve`'s worker: start `tailwatch worker` as a child, restart it when it dies, stop it.

The child reads its stdin from a pipe only this process writes to: when `serve` exits,
however it exits, the pipe closes and the worker stops (`monitor.parent_watch`). When the
worker dies, it is logged and started again after a backoff (1 s, doubling up to
`worker.restart_backoff_max_s`; back to 1 s after a run that lasted longer than that).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from monitor.settings import Settings

log = logging.getLogger(__name__)

STOP_WAIT_S = 15.0  # a running evaluation finishes before the worker exits


def worker_command(config_file: str | None) -> list[str]:
    """Return the command line of `serve`'s worker."""
    config = ["--config", config_file] if config_file else []
    return [sys.executable, "-m", "monitor.cli", *config, "worker", "--exit-with-parent"]


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
                 backoff_max_s: float = 60.0, output: IO[bytes] | None = None) -> None:
        self._command = list(command)
        self._env = dict(env)
        self._output = output  # the child's stdout and stderr (None: this process's)
        self._backoff_max_s = backoff_max_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.restarts = 0

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
            if time.monotonic() - started > self._backoff_max_s:
                backoff = 1.0
            log.error("tailwatch: the analysis worker (pid %d) exited with code %d; "
                      "restarting it in %.0f s", proc.pid, code, backoff)
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, self._backoff_max_s)
            self.restarts += 1
            self._spawn()

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
