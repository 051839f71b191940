"""A 10 MB /v1/generate body is refused at the HTTP layer, unread: 413, flat memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest

from monitor.api.limits import default_max_body_bytes
from monitor.loopback import wait_for
from monitor.settings import Settings
from tests.monitor.conftest import start
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer

TEN_MB = 10 * 1024 * 1024
CHUNK = b"a" * 65536  # one object sent again and again: the client allocates nothing new
RSS_BOUND = 8 * 1024 * 1024  # the body alone would be 10 MB, its JSON string 10 MB more


@pytest.fixture
def db_kind() -> str:
    """Run on SQLite only: the cap sits in front of any database."""
    return "sqlite"


def body() -> Iterator[bytes]:
    yield b'{"text": "'
    for _ in range(TEN_MB // len(CHUNK)):
        yield CHUNK
    yield b'"}'


class PeakRss:
    """Sample this process's RSS every millisecond in a thread; keep the peak."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_default_cap_admits_the_longest_text_the_engine_could_take() -> None:
    assert default_max_body_bytes(1024) == 1024 * 32 * 6 + 16 * 1024  # about 208 KiB


def test_a_10_mb_body_is_refused_unread_with_flat_memory(settings: Settings) -> None:
    factory = FakeFactory()
    app = start(settings, factory)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200)
        ok = client.post("/v1/generate", json={"text": "the river runs", "max_new_tokens": 2})
        assert ok.status_code == 200, ok.text
        rss = psutil.Process().memory_info().rss
        with PeakRss() as declared_peak:
            declared = client.post("/v1/generate", content=body(),
                                   headers={"Content-Type": "application/json",
                                            "Content-Length": str(TEN_MB + 12)})
        with PeakRss() as chunked_peak:
            chunked = client.post("/v1/generate", content=body(),
                                  headers={"Content-Type": "application/json"})
        after = client.post("/v1/generate", json={"text": "the river", "max_new_tokens": 2})
    for response in (declared, chunked):
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "input_too_long" and "api.max_body_bytes" in error["message"]
    assert str(TEN_MB + 12) in declared.json()["error"]["message"]
    assert declared_peak.peak - rss < RSS_BOUND
    assert chunked_peak.peak - rss < RSS_BOUND
    assert after.status_code == 200  # the service serves on
