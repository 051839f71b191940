"""A loopback webhook receiver that records every POST (what a pager would get)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class Delivery:
    """One POST the receiver answered: when, where and the JSON body (None if not JSON)."""

    at: float  # time.time()
    path: str
    body: Any


class WebhookReceiver:
    """Serve POSTs on 127.0.0.1 (a free port) and keep them, optionally as JSON lines.

    Example:
        with WebhookReceiver() as rx:
            settings = ... rx.url ...
            rx.alerts("acceptance_drop", "firing")   # Alertmanager-format alerts seen
    """

    def __init__(self, log_file: Path | None = None) -> None:
        self._lock = threading.Lock()
        self._deliveries: list[Delivery] = []
        self._log_file = log_file
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                receiver._record(Delivery(time.time(), self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return  # the narration reports deliveries; no stderr noise

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="demo-webhook-receiver", daemon=True)

    def _record(self, d: Delivery) -> None:
        with self._lock:
            self._deliveries.append(d)
            if self._log_file is not None:
                with self._log_file.open("a") as f:
                    f.write(json.dumps({"at": d.at, "path": d.path, "body": d.body}) + "\n")

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def deliveries(self) -> list[Delivery]:
        """Return every POST so far, oldest first."""
        with self._lock:
            return list(self._deliveries)

    def alerts(self, rule: str | None = None, status: str | None = None,
               since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        """Return (arrival time, alert) of Alertmanager-format alerts matching rule/status."""
        out = []
        for d in self.deliveries():
            if d.at < since or not isinstance(d.body, dict):
                continue
            for a in d.body.get("alerts") or []:
                labels = a.get("labels") or {}
                if rule is not None and labels.get("alertname") != rule:
                    continue
                if status is not None and a.get("status") != status:
                    continue
                out.append((d.at, a))
        return out
