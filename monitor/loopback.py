"""Loopback plumbing the demo, the benchmarks and the tests share.

A free port, a wait for a condition nothing signals, and a webhook receiver that records
every POST and answers as scripted: the demo's pager, and the receiver whose errors,
stalls and held requests exercise the outbox's retries and isolation in the tests and
`bench.faults` (tests are not an installed package, so this lives here).

Example:
    with WebhookReceiver(secret="s3cret") as rx:
        settings = ... rx.url ...
        rx.alerts("acceptance_drop", "firing")   # Alertmanager-format alerts seen
        rx.accepted                              # idempotency key -> 2xx answers
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from alerts.webhooks import IDEMPOTENCY_HEADER, SIGNATURE_HEADER, verify_signature

T = TypeVar("T")


def free_port() -> int:
    """Return a loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, *,
             interval_s: float = 0.01, what: str = "condition") -> T:
    """Poll `predicate` until it returns a truthy value and return that value.

    Raises TimeoutError naming `what` after `timeout_s`. For conditions nothing signals (a
    server's readiness, a row another thread writes); where the code under test can set an
    event, wait on the event instead.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s:g} s")
        time.sleep(interval_s)
    return value


# A scripted answer: a status, or ("sleep", seconds): stall past the sender's timeout, then 503.
Step = int | tuple[str, float]


@dataclass(frozen=True)
class Delivery:
    """One POST the receiver answered: when, where, its key, bytes and the answer."""

    at: float  # time.time()
    path: str
    key: str | None  # Idempotency-Key header
    raw: bytes
    step: Step  # the scripted answer it got (401 when its signature was wrong)
    signature: str | None

    @property
    def body(self) -> Any:
        """Return the JSON body, or None when it is not JSON."""
        try:
            return json.loads(self.raw)
        except ValueError:
            return None

    @property
    def ok(self) -> bool:
        """Return whether it was answered 2xx."""
        return isinstance(self.step, int) and 200 <= self.step < 300


class WebhookReceiver:
    """Serve POSTs on 127.0.0.1:`port` (a free one by default) from `start()` to `stop()`.

    The port is fixed at construction, so a target can point at the URL before the
    receiver listens (connections are refused until `start()`), and it can stop and start
    again on the same port.

    Args:
        secret: when set, every signature is checked; a wrong one is answered 401.
        script: answers for the next requests, consumed in order; afterwards `default`
            (both may be changed while serving).
        hold: when set, each request first waits up to `hold_s` for this event; one not
            released in time is answered 503 (`held` records, per request, whether released).
        after_accept: called with the receiver after each 2xx (e.g. to release another one).
        log_file: every POST is appended there as a JSON line.
    """

    def __init__(self, *, port: int = 0, secret: str | None = None,
                 script: list[Step] | None = None, default: Step = 200,
                 hold: threading.Event | None = None, hold_s: float = 5.0,
                 after_accept: Callable[[WebhookReceiver], None] | None = None,
                 log_file: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.secret = secret
        self.script: list[Step] = list(script or [])
        self.default: Step = default
        self.hold = hold
        self.hold_s = hold_s
        self.after_accept = after_accept
        self.accepted: Counter[str | None] = Counter()
        self.bad_signatures = 0
        self.held: list[bool] = []
        self._log_file = log_file
        self._deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen on the port (until now connections were refused)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, stall = receiver.handle(self.path, self.headers, body)
                if stall:
                    time.sleep(stall)  # the scripted stall: the sender gives up first
                with contextlib.suppress(OSError):  # the sender may have hung up
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                return  # callers report deliveries; no stderr noise

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever,
                                        name="webhook-receiver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening (connections are refused again)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> WebhookReceiver:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def handle(self, path: str, headers: Any, body: bytes) -> tuple[int, float]:
        """Answer one POST; return (status, seconds to stall before answering)."""
        key = headers.get(IDEMPOTENCY_HEADER)
        signature = headers.get(SIGNATURE_HEADER)
        if self.hold is not None:
            released = self.hold.wait(self.hold_s)
            with self._lock:
                self.held.append(released)
            if not released:
                self._record(Delivery(time.time(), path, key, body, 503, signature))
                return 503, 0.0
        status, stall = self._answer(path, key, signature, body)
        if 200 <= status < 300 and self.after_accept is not None:
            self.after_accept(self)
        return status, stall

    def _answer(self, path: str, key: str | None, signature: str | None,
                body: bytes) -> tuple[int, float]:
        with self._lock:
            step = self.script.pop(0) if self.script else self.default
        if self.secret is not None and not verify_signature(self.secret, body, signature):
            with self._lock:
                self.bad_signatures += 1
            self._record(Delivery(time.time(), path, key, body, 401, signature))
            return 401, 0.0
        self._record(Delivery(time.time(), path, key, body, step, signature))
        if isinstance(step, tuple):
            return 503, step[1]  # stalls, then fails: the sender gave up long ago
        if 200 <= step < 300:
            with self._lock:
                self.accepted[key] += 1
        return step, 0.0

    def _record(self, d: Delivery) -> None:
        with self._lock:
            self._deliveries.append(d)
            if self._log_file is not None:
                with self._log_file.open("a") as f:
                    f.write(json.dumps({"at": d.at, "path": d.path, "body": d.body}) + "\n")

    def deliveries(self) -> list[Delivery]:
        """Return every POST so far, oldest first."""
        with self._lock:
            return list(self._deliveries)

    def bodies(self, key: str) -> set[bytes]:
        """Return the distinct bodies sent under `key`."""
        return {d.raw for d in self.deliveries() if d.key == key}

    def order(self) -> list[str | None]:
        """Return the idempotency keys of 2xx-answered requests in arrival order."""
        return [d.key for d in self.deliveries() if d.ok]

    def payloads(self) -> list[Any]:
        """Return the JSON of every 2xx-answered request."""
        return [d.body for d in self.deliveries() if d.ok]

    def alerts(self, rule: str | None = None, status: str | None = None,
               since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        """Return (arrival time, alert) of Alertmanager-format alerts matching rule/status."""
        out = []
        for d in self.deliveries():
            body = d.body
            if d.at < since or not isinstance(body, dict):
                continue
            for a in body.get("alerts") or []:
                labels = a.get("labels") or {}
                if rule is not None and labels.get("alertname") != rule:
                    continue
                if status is not None and a.get("status") != status:
                    continue
                out.append((d.at, a))
        return out
