"""Run the tailwatch app under a real uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from monitor.demo.errors import DemoSetupError
from monitor.loopback import wait_for


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
