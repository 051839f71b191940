"""POST /v1/generate on a real server: a client that hangs up cancels its request.

The engine is the service fake held on its hang (released only by the test, or by the
request's cancel signal), so a call that returns did so because it was cancelled.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.errors import Cancelled
from engine.protocol import CancelSignal, FlagOverride, FlagProvider, GenerateResult
from monitor.hub import services_of
from monitor.loopback import wait_for
from monitor.settings import Settings
from tests.monitor.conftest import make_settings, start
from tests.monitor.fakes import FakeFactory, ServiceFakeEngine
from tests.monitor.live import LiveServer

BODY = b'{"text": "the river runs", "max_new_tokens": 4}'


@pytest.fixture
def db_kind() -> str:
    """Run on SQLite only: no database is on this path."""
    return "sqlite"


@pytest.fixture
def settings(migrated_url: str) -> Settings:
    """Return test settings with one decode slot: a second request queues."""
    return make_settings(migrated_url, engine={
        "buckets": (16, 32, 64), "max_input_tokens": 128, "max_new_tokens": 8,
        "max_new_tokens_cap": 64, "max_queue": 4, "max_concurrency": 1})


@pytest.fixture
def errors_logged(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """Return the ERROR records logged, uvicorn's own included (it does not propagate)."""
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(caplog.handler)
    try:
        yield caplog.records
    finally:
        server_log.removeHandler(caplog.handler)


class NotingEngine(ServiceFakeEngine):
    """The service fake engine, noting each call's cancel signal and what it came to."""

    def __init__(self, config: EngineConfig, flags: FlagProvider) -> None:
        super().__init__(config, flags)
        self.calls: list[tuple[CancelSignal | None, GenerateResult | BaseException]] = []

    def generate(self, text: str, *, max_new_tokens: int | None = None, canary: bool = False,
                 override: FlagOverride | None = None, timeout_s: float | None = None,
                 cancel: CancelSignal | None = None) -> GenerateResult:
        try:
            result = super().generate(text, max_new_tokens=max_new_tokens, canary=canary,
                                      override=override, timeout_s=timeout_s, cancel=cancel)
        except BaseException as exc:
            self.calls.append((cancel, exc))
            raise
        self.calls.append((cancel, result))
        return result

    def from_http(self) -> list[tuple[CancelSignal | None, GenerateResult | BaseException]]:
        """Return the calls the API made (it always hands a cancel signal)."""
        return [call for call in self.calls if call[0] is not None]


class NotingFactory(FakeFactory):
    """Build NotingEngine."""

    def __call__(self, config: EngineConfig, flags: FlagProvider) -> NotingEngine:
        engine = NotingEngine(config, flags)
        self.engine = engine
        self.built.set()
        return engine


def post_raw(port: int) -> socket.socket:
    """Send a whole POST /v1/generate on a new connection and return its socket, unread."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
    return sock


@pytest.mark.parametrize("where", ["running", "queued"])
def test_a_client_that_hangs_up_cancels_its_request_and_frees_its_slot(
        settings: Settings, errors_logged: list[logging.LogRecord], where: str) -> None:
    factory, registry = NotingFactory(), CollectorRegistry()
    app = start(settings, factory, registry)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        engine = factory.engine
        assert isinstance(engine, NotingEngine) and engine.admission is not None
        admission = engine.admission
        engine.hang.set()
        holder = threading.Thread(target=engine.generate, args=("the river",))
        if where == "queued":  # a call that is never cancelled holds the one slot
            holder.start()
            wait_for(lambda: admission.running == 1, what="the slot held")
        sock = post_raw(live.port)
        if where == "queued":
            wait_for(lambda: admission.waiting == 1, what="the request queued")
        else:
            wait_for(lambda: admission.running == 1, what="the request running")
        sock.close()
        wait_for(lambda: engine.from_http(), what="the request's engine call returned")
        [(cancel, outcome)] = engine.from_http()
        assert cancel is not None and cancel.is_set()
        assert isinstance(outcome, Cancelled)
        # It left the queue or its slot: only the holder (when there is one) is left.
        assert admission.waiting == 0
        assert admission.running == (1 if where == "queued" else 0)
        engine.release.set()
        if where == "queued":
            holder.join(30)
        # Counted as cancelled; no latency sample, refusal or failure in its bucket's rollup.
        assert registry.get_sample_value(
            "tailwatch_requests_rejected_total", {"reason": "cancelled"}) == 1
        assert registry.get_sample_value(
            "tailwatch_request_duration_seconds_count",
            {"bucket": "16", "path": "compiled", "decoding": "speculative"}) is None
        assert services_of(app).traffic.drain() == []
        # The slot is free for the next caller.
        engine.hang.clear()
        after = client.post("/v1/generate", content=BODY,
                            headers={"Content-Type": "application/json"})
        assert after.status_code == 200, after.text
    assert [r.getMessage() for r in errors_logged if r.levelno >= logging.ERROR] == []
