"""The SQL outbox against a real, flaky HTTP receiver on loopback."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.outbox import Deliverer, enqueue, enqueue_message, pending_count
from alerts.webhooks import AlertInfo, Notification, WebhookTarget
from storage.models import WebhookDelivery
from tests.alerts.receiver import Receiver, free_port, serve

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def note(i: int, status: str = "firing") -> Notification:
    info = AlertInfo(alert_id=i, rule="p99", fingerprint=f"fp{i}", labels={"bucket": "64"},
                     annotations={}, severity="page", status=status, starts_at=T0, ends_at=None)
    return Notification(key=f"tw-alert-{i}-{status}", title=f"alert {i}", text="t", at=T0,
                        alert=info)


def deliver_until_done(make: callable, clock: Clock, rounds: int = 12) -> int:
    n = 0
    for _ in range(rounds):
        with make() as d:
            d.run_once()
        n += 1
        clock.advance(1000)  # past any backoff (max 900 s): the next round retries all
        with d.sessions() as s:
            if pending_count(s) == 0:
                return n
    return n


def test_flaky_receiver_gets_every_notification_exactly_once(sessionmaker: sessionmaker[Session]):
    port = free_port()
    url = f"http://127.0.0.1:{port}/hook"
    tgt = WebhookTarget(name="ops", url=url, format="alertmanager", secret="s3cret",
                        timeout_s=0.3)
    clock = Clock()
    with sessionmaker.begin() as s:
        for i in range(3):
            enqueue(s, note(i), [tgt])
        enqueue_message(s, "Weekly report", "p99 stable", [tgt], now=T0, key="report-2026-W48")
        # Enqueuing the same report again (job re-run) adds nothing.
        assert enqueue_message(s, "Weekly report", "p99 stable", [tgt], now=T0,
                               key="report-2026-W48") == []
    keys = {f"tw-alert-{i}-firing" for i in range(3)} | {"report-2026-W48"}

    def make() -> Deliverer:
        # A new Deliverer each round: delivery state lives in SQL, so restarts resume.
        return Deliverer(sessionmaker, [tgt], clock=clock, rng=random.Random(3))

    # Phase 1: nothing listens: connections are refused, every row is kept for retry.
    with make() as d:
        report = d.run_once()
    assert report.claimed == 4 and report.retried == 4 and report.delivered == 0
    with sessionmaker() as s:
        rows = s.scalars(select(WebhookDelivery)).all()
        assert all(r.state == "pending" and r.attempts == 1 for r in rows)
        assert all("ConnectError" in (r.last_error or "") for r in rows)
        assert all(r.next_attempt_at > clock.now for r in rows)
    # Not due yet: a run before the backoff ends sends nothing.
    with make() as d:
        assert d.run_once().claimed == 0
    clock.advance(1000)
    # Phase 2: the receiver comes up but answers 503, then stalls past the timeout, then heals.
    rx = Receiver(secret="s3cret", script=[503, 503, ("sleep", 0.8), 502])
    with serve(rx, port):
        rounds = deliver_until_done(make, clock)
    assert rounds <= 4
    assert rx.bad_signatures == 0
    assert set(rx.accepted) == keys
    assert all(n == 1 for n in rx.accepted.values())  # none arrives twice under one key
    for k in keys:
        assert len(rx.bodies(k)) == 1  # retries resend the identical, signed bytes
    with sessionmaker() as s:
        rows = s.scalars(select(WebhookDelivery)).all()
        assert {r.state for r in rows} == {"delivered"}
        assert max(r.attempts for r in rows) >= 3
        assert any("timeout" in (r.last_error or "") or r.last_error is None for r in rows)
    payload = next(p for p in rx.payloads() if p["idempotencyKey"] == "tw-alert-1-firing")
    assert payload["version"] == "4" and payload["alerts"][0]["fingerprint"] == "fp1"


def test_timeout_is_retried_and_recorded(sessionmaker: sessionmaker[Session]):
    rx = Receiver(script=[("sleep", 0.6)])
    clock = Clock()
    with serve(rx) as url:
        tgt = WebhookTarget(name="slow", url=url, timeout_s=0.2)
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [tgt])
        with Deliverer(sessionmaker, [tgt], clock=clock) as d:
            assert d.run_once().retried == 1
        with sessionmaker() as s:
            row = s.scalars(select(WebhookDelivery)).one()
            assert row.state == "pending" and "timeout" in row.last_error
        clock.advance(1000)
        with Deliverer(sessionmaker, [tgt], clock=clock) as d:
            assert d.run_once().delivered == 1
    assert rx.accepted == {"tw-alert-1-firing": 1}


def test_4xx_is_failed_without_retry(sessionmaker: sessionmaker[Session]):
    rx = Receiver(default=400)
    clock = Clock()
    with serve(rx) as url:
        tgt = WebhookTarget(name="strict", url=url, format="slack")
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [tgt])
        for _ in range(3):
            with Deliverer(sessionmaker, [tgt], clock=clock) as d:
                d.run_once()
            clock.advance(1000)
    assert len(rx.requests) == 1
    with sessionmaker() as s:
        row = s.scalars(select(WebhookDelivery)).one()
        assert row.state == "failed" and row.last_status == 400 and row.attempts == 1


def test_429_and_5xx_are_retried(sessionmaker: sessionmaker[Session]):
    rx = Receiver(script=[429, 500])
    clock = Clock()
    with serve(rx) as url:
        tgt = WebhookTarget(name="t", url=url)
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [tgt])
        rounds = deliver_until_done(lambda: Deliverer(sessionmaker, [tgt], clock=clock), clock)
    assert rounds == 3 and rx.accepted == {"tw-alert-1-firing": 1}


def test_unconfigured_target_is_kept_not_lost(sessionmaker: sessionmaker[Session]):
    tgt = WebhookTarget(name="gone", url="http://127.0.0.1:9/x")
    with sessionmaker.begin() as s:
        enqueue(s, note(1), [tgt])
    with Deliverer(sessionmaker, [], clock=Clock()) as d:
        assert d.run_once().retried == 1
    with sessionmaker() as s:
        row = s.scalars(select(WebhookDelivery)).one()
        assert row.state == "pending" and "not configured" in row.last_error


def test_backoff_doubles_with_jitter_and_caps():
    d = Deliverer.__new__(Deliverer)
    d.backoff_base_s, d.backoff_max_s, d.rng = 2.0, 60.0, random.Random(0)
    for attempts, full in [(1, 2.0), (2, 4.0), (3, 8.0), (6, 60.0), (20, 60.0)]:
        waits = [d.backoff_s(attempts) for _ in range(50)]
        assert all(full * 0.5 <= w <= full for w in waits)
        assert max(waits) - min(waits) > 0  # jittered


def test_claim_leases_rows_so_a_second_deliverer_skips_them(sessionmaker: sessionmaker[Session]):
    tgt = WebhookTarget(name="t", url="http://127.0.0.1:9/x")
    with sessionmaker.begin() as s:
        for i in range(3):
            enqueue(s, note(i), [tgt])
    clock = Clock()
    a = Deliverer(sessionmaker, [tgt], clock=clock)
    b = Deliverer(sessionmaker, [tgt], clock=clock)
    try:
        assert len(a.claim()) == 3
        assert b.claim() == []  # leased by a; after the lease they are due again
        clock.advance(a.lease_s + 1)
        assert len(b.claim()) == 3
    finally:
        a.close()
        b.close()
