"""A small HTTP server for a process without the API: GET /healthz and GET /metrics.

`tailwatch worker` runs no FastAPI app and no engine; this stdlib server answers its
health checks and Prometheus scrapes on `worker.port` in a daemon thread.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from monitor.auth import Authenticator, AuthError

log = logging.getLogger(__name__)


class HealthServer:
    """Serve /healthz (JSON from `health()`) and /metrics (`registry`) on host:port.

    Example:
        server = HealthServer("127.0.0.1", 8001, registry, lambda: {"status": "ok"})
        server.start()
        server.port     # the bound port (0 asks the OS for a free one)
        server.close()
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 health: Callable[[], Mapping[str, object]],
                 authenticator: Authenticator | None = None) -> None:
        handler = _handler(registry, health, authenticator)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """Return the port the server listens on."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="tailwatch-health-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()


def _handler(registry: CollectorRegistry, health: Callable[[], Mapping[str, object]],
             authenticator: Authenticator | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                body = health()
                status = 200 if body.get("status") == "ok" else 503
                self._send(status, "application/json", json.dumps(body).encode())
            elif path == "/metrics":
                if authenticator is not None:
                    try:  # as the API's /metrics: a token only when api.read_auth
                        authenticator.actor(self.headers.get("Authorization"), write=False)
                    except AuthError as exc:
                        self._send(exc.status, "application/json",
                                   json.dumps({"detail": str(exc)}).encode())
                        return
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._send(404, "application/json",
                           json.dumps({"detail": f"no route {path}; try /healthz or /metrics"})
                           .encode())

        def _send(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("health http: " + format, *args)

    return Handler
