"""A real HTTP webhook receiver on loopback whose behaviour a test scripts."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from alerts.webhooks import verify_signature


def free_port() -> int:
    """Return a loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Receiver:
    """Behaviour script and what arrived.

    script: responses for the next requests, consumed in order: an int status, or
        ("sleep", seconds) to stall past the client's timeout; afterwards `default`.
    accepted: idempotency key -> number of requests answered 2xx under that key.
    hold: when set, each request first waits up to `hold_s` for this event; one not
        released in time is answered 503 (`held` records, per request, whether released).
    after_accept: called with the receiver after each 2xx (e.g. to release another one).
    """

    secret: str | None = None
    script: list[Any] = field(default_factory=list)
    default: int = 200
    requests: list[dict[str, Any]] = field(default_factory=list)
    accepted: dict[str, int] = field(default_factory=dict)
    bad_signatures: int = 0
    hold: threading.Event | None = None
    hold_s: float = 5.0
    held: list[bool] = field(default_factory=list)
    after_accept: Callable[[Receiver], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, headers: Any, body: bytes) -> tuple[int, float]:
        key = headers.get("Idempotency-Key")
        if self.hold is not None:
            released = self.hold.wait(self.hold_s)
            with self.lock:
                self.held.append(released)
            if not released:
                with self.lock:
                    self.requests.append({"key": key, "body": body, "step": 503,
                                          "signature": None})
                return 503, 0.0
        status, stall = self._answer(key, headers, body)
        if 200 <= status < 300 and self.after_accept is not None:
            self.after_accept(self)
        return status, stall

    def _answer(self, key: str | None, headers: Any, body: bytes) -> tuple[int, float]:
        with self.lock:
            step = self.script.pop(0) if self.script else self.default
            self.requests.append({"key": key, "body": body, "step": step,
                                  "signature": headers.get("X-Tailwatch-Signature")})
            if self.secret is not None and not verify_signature(
                    self.secret, body, headers.get("X-Tailwatch-Signature")):
                self.bad_signatures += 1
                return 401, 0.0
            if isinstance(step, tuple):
                return 503, step[1]  # stalls, then fails: the sender gave up long ago
            if 200 <= step < 300:
                self.accepted[key] = self.accepted.get(key, 0) + 1
            return step, 0.0

    def bodies(self, key: str) -> set[bytes]:
        """Return the distinct bodies sent under `key`."""
        return {r["body"] for r in self.requests if r["key"] == key}

    def order(self) -> list[str]:
        """Return the idempotency keys of 2xx-answered requests in arrival order."""
        return [r["key"] for r in self.requests
                if isinstance(r["step"], int) and 200 <= r["step"] < 300]

    def payloads(self) -> list[Any]:
        """Return the JSON of every 2xx-answered request."""
        return [json.loads(r["body"]) for r in self.requests
                if isinstance(r["step"], int) and 200 <= r["step"] < 300]


@contextmanager
def serve(receiver: Receiver, port: int = 0) -> Iterator[str]:
    """Run `receiver` on 127.0.0.1:port in a thread; yield its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, stall = receiver.handle(self.headers, body)
            if stall:
                time.sleep(stall)
            try:
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
            except OSError:
                pass  # the client timed out and closed the connection

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
