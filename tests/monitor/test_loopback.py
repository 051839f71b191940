"""The loopback plumbing shared by the demo, the benchmarks and the tests."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from monitor.loopback import WebhookReceiver, free_port, wait_for


def test_free_port_refuses_connections() -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.post(f"http://127.0.0.1:{free_port()}/hook", json={})


def test_wait_for_returns_once_the_condition_holds_and_names_it_on_timeout() -> None:
    done = threading.Event()
    threading.Timer(0.0, done.set).start()
    wait_for(done.is_set, 5)
    with pytest.raises(TimeoutError, match="the receiver ready not reached within 0.05 s"):
        wait_for(lambda: False, 0.05, what="the receiver ready")


def test_receiver_restarts_on_its_port_and_logs_every_post(tmp_path: Path) -> None:
    log = tmp_path / "hooks.jsonl"
    rx = WebhookReceiver(log_file=log, script=[503])
    with pytest.raises(httpx.ConnectError):  # the URL is known before it listens
        httpx.post(rx.url, json={})
    alert = {"status": "firing", "labels": {"alertname": "acceptance_drop"}}
    with rx:
        assert httpx.post(rx.url, json={"alerts": [alert]},
                          headers={"Idempotency-Key": "k1"}).status_code == 503
    with rx:
        assert httpx.post(rx.url, json={"alerts": [alert]},
                          headers={"Idempotency-Key": "k1"}).status_code == 200
        assert httpx.post(rx.url, content=b"not json").status_code == 200
    assert rx.accepted == {"k1": 1, None: 1}
    assert [a for _, a in rx.alerts("acceptance_drop", "firing")] == [alert, alert]
    assert rx.alerts("acceptance_drop", "resolved") == []
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["body"] for x in lines] == [{"alerts": [alert]}, {"alerts": [alert]}, None]


def test_receiver_refuses_a_wrong_signature() -> None:
    with WebhookReceiver(secret="s3cret") as rx:
        r = httpx.post(rx.url, content=b"{}", headers={"X-Tailwatch-Signature": "sha256=00"})
    assert r.status_code == 401 and rx.bad_signatures == 1 and rx.payloads() == []
