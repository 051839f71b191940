"""Run the tailwatch app under a real uvicorn on a free loopback port, its analysis in a child."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from types import TracebackType

import uvicorn
import yaml
from fastapi import FastAPI

from monitor.demo.errors import DemoSetupError
from monitor.loopback import wait_for
from monitor.settings import Settings


class ServiceThread:
    """Serve `app` on 127.0.0.1 until the with-block ends (lifespan included).

    Example:
        with ServiceThread(app) as service:
            httpx.get(service.url + "/healthz")
    """

    def __init__(self, app: FastAPI, *, start_timeout_s: float = 60.0) -> None:
        self.app = app
        self.start_timeout_s = start_timeout_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name="demo-uvicorn", daemon=True)

    def __enter__(self) -> ServiceThread:
        self._thread.start()
        try:
            wait_for(lambda: self._server.started or not self._thread.is_alive(),
                     self.start_timeout_s, interval_s=0.02)
        except TimeoutError:
            self.__exit__(None, None, None)
            raise DemoSetupError(
                f"the service did not start in {self.start_timeout_s:g} s") from None
        if not self._server.started:
            self._sock.close()
            raise DemoSetupError("the service exited during start-up (see the demo log)")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        self._sock.close()


def write_config(settings: Settings, path: Path) -> Path:
    """Write `settings` to `path` as a config file `tailwatch --config` reads back (mode 0600)."""
    data = settings.model_dump(mode="json")
    # A dump masks secrets; the worker reads them back, so they are written in the clear.
    data["api"]["tokens"] = [{"name": t.name, "token": t.token.get_secret_value()}
                             for t in settings.api.tokens]
    if settings.api_token is not None:
        data["api_token"] = settings.api_token.get_secret_value()
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # a kept directory's earlier file may have been readable by others
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class AnalysisProcess:
    """Run `settings`' analysis (evaluation, delivery, the report) in a `tailwatch worker` child.

    As under `tailwatch serve`: beside the engine in one process, the analysis would hold
    the interpreter's lock while canaries run and slow what it measures. The worker's
    output goes to `log_file`; it stops with the with-block (or with this process).

    Example:
        with ServiceThread(create_app(s, analysis_in_process=False)) as service, \\
                AnalysisProcess(s, service.port, workdir):
            ...
    """

    def __init__(self, settings: Settings, api_port: int, workdir: Path) -> None:
        from monitor.supervisor import WorkerSupervisor, worker_command, worker_env

        config = write_config(settings, workdir / "demo-config.yaml")
        # Alerts name the service by api.host:api.port: the port the demo serves on.
        env = {**worker_env(settings), "TAILWATCH_API__PORT": str(api_port)}
        self.log_file = workdir / "worker.log"
        self._log = self.log_file.open("ab")
        self._supervisor = WorkerSupervisor(
            worker_command(str(config)), env,
            backoff_max_s=settings.worker.restart_backoff_max_s, output=self._log)

    @property
    def pid(self) -> int | None:
        """Return the worker's pid while it runs."""
        return self._supervisor.pid

    def __enter__(self) -> AnalysisProcess:
        self._supervisor.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._supervisor.stop()
        finally:
            self._log.close()
