"""The SQL outbox against a real, flaky HTTP receiver on loopback."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from alerts.outbox import Deliverer, enqueue, enqueue_message, retry_dead
from alerts.webhooks import AlertInfo, Notification, WebhookTarget
from monitor.loopback import WebhookReceiver, free_port, wait_for
from storage.models import Alert, WebhookDelivery
from storage.queries.deliveries import pending_count

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

    # Phase 1: nothing listens: the first connection is refused and the target counts
    # as down for this run: the other rows wait with it (not attempted), all kept.
    with make() as d:
        report = d.run_once()
    assert report.claimed == 4 and report.retried == 1 and report.deferred == 3
    assert report.delivered == 0
    with sessionmaker() as s:
        rows = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)).all()
        assert all(r.state == "pending" for r in rows)
        assert [r.attempts for r in rows] == [1, 0, 0, 0]
        assert "ConnectError" in (rows[0].last_error or "")
        assert all(r.next_attempt_at > clock.now for r in rows)
    # Not due yet: a run before the backoff ends sends nothing.
    with make() as d:
        assert d.run_once().claimed == 0
    clock.advance(1000)
    # Phase 2: the receiver comes up but answers 503, then stalls past the timeout, then heals.
    rx = WebhookReceiver(port=port, secret="s3cret", script=[503, 503, ("sleep", 0.8), 502])
    with rx:
        rounds = deliver_until_done(make, clock)
    assert rounds == 5  # one failure per round (the target is down), then all at once
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
    rx = WebhookReceiver(script=[("sleep", 0.6)])
    clock = Clock()
    with rx:
        url = rx.url
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
    rx = WebhookReceiver(default=400)
    clock = Clock()
    with rx:
        url = rx.url
        tgt = WebhookTarget(name="strict", url=url, format="slack")
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [tgt])
        for _ in range(3):
            with Deliverer(sessionmaker, [tgt], clock=clock) as d:
                d.run_once()
            clock.advance(1000)
    assert len(rx.deliveries()) == 1
    with sessionmaker() as s:
        row = s.scalars(select(WebhookDelivery)).one()
        assert row.state == "failed" and row.last_status == 400 and row.attempts == 1


def test_429_and_5xx_are_retried(sessionmaker: sessionmaker[Session]):
    rx = WebhookReceiver(script=[429, 500])
    clock = Clock()
    with rx:
        url = rx.url
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
    with Deliverer(None, [], backoff_base_s=2.0, backoff_max_s=60.0,  # type: ignore[arg-type]
                   rng=random.Random(0)) as d:
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


def alert_row(session: Session, fp: str = "fp1") -> int:
    a = Alert(fingerprint=fp, rule="p99", labels={"bucket": "64"}, severity="page",
              state="firing", started_at=T0, fired_at=T0, updated_at=T0)
    session.add(a)
    session.flush()
    return a.id


def transition(alert_id: int, status: str, at: datetime = T0) -> Notification:
    info = AlertInfo(alert_id=alert_id, rule="p99", fingerprint="fp1", labels={"bucket": "64"},
                     annotations={}, severity="page", status=status, starts_at=T0,
                     ends_at=at if status == "resolved" else None)
    return Notification(key=f"tw-{alert_id}-{status}", title=f"p99 {status}", text="t", at=at,
                        alert=info)


def test_a_hanging_target_costs_only_itself(sessionmaker: sessionmaker[Session]):
    # The hung receiver holds each request until the healthy one has taken all three of its
    # notifications: it can only answer 200 if both targets are served at the same time.
    release = threading.Event()
    hung = WebhookReceiver(hold=release, hold_s=3.0)
    healthy = WebhookReceiver(after_accept=lambda rx: release.set() if len(rx.accepted) == 3 else None)
    with hung, healthy:
        hung_url = hung.url
        ok_url = healthy.url
        slow = WebhookTarget(name="a-hung", url=hung_url, timeout_s=30)
        ok = WebhookTarget(name="b-ok", url=ok_url)
        with sessionmaker.begin() as s:
            for i in range(3):
                enqueue(s, note(i), [slow, ok])  # the hung target's rows come first
        with Deliverer(sessionmaker, [slow, ok], clock=Clock()) as d:
            report = d.run_once()
    assert healthy.order() == [f"tw-alert-{i}-firing" for i in range(3)]
    assert hung.held[0] is True  # released by the healthy target's deliveries, not timed out
    assert report.delivered == 6 and report.retried == 0
    assert set(hung.accepted) == set(healthy.accepted)


def test_a_hanging_target_does_not_hold_up_later_runs(sessionmaker: sessionmaker[Session]):
    # run_wait_s bounds each run: the hung target's drain goes on in its thread, later runs
    # skip it and serve the healthy target, and its counts come with the run it ends in.
    release = threading.Event()
    hung = WebhookReceiver(hold=release, hold_s=20.0)
    healthy = WebhookReceiver()
    clock = Clock()
    reports = []
    with hung, healthy:
        hung_url = hung.url
        ok_url = healthy.url
        slow = WebhookTarget(name="a-hung", url=hung_url, timeout_s=30)
        ok = WebhookTarget(name="b-ok", url=ok_url)
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [slow, ok])
        with Deliverer(sessionmaker, [slow, ok], clock=clock, run_wait_s=0.1) as d:
            reports.append(d.run_once())  # returns with the hung request still held
            with sessionmaker.begin() as s:
                enqueue(s, note(2), [ok])

            def runs_until(done: Callable[[], bool]) -> Callable[[], bool]:
                def run() -> bool:
                    reports.append(d.run_once())
                    return done()
                return run

            wait_for(runs_until(lambda: len(healthy.accepted) == 2), interval_s=0.05,
                     what="the healthy target's two deliveries")
            assert set(healthy.accepted) == {"tw-alert-1-firing", "tw-alert-2-firing"}
            assert hung.held == []  # both went while the hung request was still unanswered
            release.set()
            wait_for(runs_until(lambda: sum(r.delivered for r in reports) == 3),
                     interval_s=0.05, what="three deliveries")
    assert hung.held == [True] and hung.accepted == {"tw-alert-1-firing": 1}
    assert sum(r.delivered for r in reports) == 3 and sum(r.claimed for r in reports) == 3


def test_resolved_waits_for_its_firing(sessionmaker: sessionmaker[Session]):
    rx = WebhookReceiver(script=[503])
    clock = Clock()
    with rx:
        url = rx.url
        tgt = WebhookTarget(name="t", url=url)
        with sessionmaker.begin() as s:
            aid = alert_row(s)
            enqueue(s, transition(aid, "firing"), [tgt], alert_id=aid)
            enqueue(s, transition(aid, "resolved"), [tgt], alert_id=aid)
        with Deliverer(sessionmaker, [tgt], clock=clock) as d:
            first = d.run_once()
            assert first.retried == 1 and first.deferred == 1 and rx.order() == []
            clock.advance(1000)
            second = d.run_once()
    assert second.delivered == 2
    assert rx.order() == [f"tw-{aid}-firing", f"tw-{aid}-resolved"]


def test_resolved_replaces_a_firing_never_delivered(sessionmaker: sessionmaker[Session]):
    port = free_port()
    tgt = WebhookTarget(name="t", url=f"http://127.0.0.1:{port}/hook")
    clock = Clock()
    with sessionmaker.begin() as s:
        aid = alert_row(s)
        enqueue(s, transition(aid, "firing"), [tgt], alert_id=aid)
    with Deliverer(sessionmaker, [tgt], clock=clock, backoff_base_s=600) as d:
        assert d.run_once().retried == 1  # nothing listens: the firing backs off 5-10 min
        clock.advance(60)
        with sessionmaker.begin() as s:
            enqueue(s, transition(aid, "resolved", clock.now), [tgt], alert_id=aid)
        rx = WebhookReceiver(port=port)
        with rx:
            report = d.run_once()
            clock.advance(1000)
            d.run_once()  # nothing left: the firing never follows its resolved
    assert report.superseded == 1 and report.delivered == 1
    assert rx.order() == [f"tw-{aid}-resolved"]
    with sessionmaker() as s:
        firing = s.scalars(select(WebhookDelivery).where(
            WebhookDelivery.idempotency_key == f"tw-{aid}-firing")).one()
    assert firing.state == "superseded" and "superseded by resolved" in firing.last_error


def test_backoff_resets_when_the_target_answers(sessionmaker: sessionmaker[Session]):
    port = free_port()
    tgt = WebhookTarget(name="t", url=f"http://127.0.0.1:{port}/hook")
    clock = Clock()
    with sessionmaker.begin() as s:
        for i in range(3):
            enqueue(s, note(i), [tgt])
    with Deliverer(sessionmaker, [tgt], clock=clock, backoff_base_s=600) as d:
        d.run_once()  # refused: all three wait 5-10 minutes
        clock.advance(30)
        with sessionmaker.begin() as s:
            enqueue_message(s, "news", "t", [tgt], now=clock.now, key="m-new")
        rx = WebhookReceiver(port=port)
        with rx:
            report = d.run_once()  # the new message is answered: the waiting ones go now
    assert report.delivered == 4
    assert rx.order() == ["m-new"] + [f"tw-alert-{i}-firing" for i in range(3)]
    with sessionmaker() as s:
        assert pending_count(s) == 0


def test_dead_letters_are_counted_and_rows_past_max_age_give_up(
        sessionmaker: sessionmaker[Session]):
    rx = WebhookReceiver(default=410)
    clock = Clock()
    with rx:
        url = rx.url
        tgt = WebhookTarget(name="strict", url=url)
        down = WebhookTarget(name="down", url=f"http://127.0.0.1:{free_port()}/x")
        with sessionmaker.begin() as s:
            enqueue(s, note(1), [tgt, down])
        with Deliverer(sessionmaker, [tgt, down], clock=clock, max_age_s=3600) as d:
            first = d.run_once()
            assert first.failed == 1 and first.dead_targets == ("strict",)
            assert first.retried == 1
            clock.advance(3601)
            late = d.run_once()
    assert late.failed == 1 and late.dead_targets == ("down",) and late.claimed == 0
    with sessionmaker() as s:
        rows = {r.target: r for r in s.scalars(select(WebhookDelivery))}
    assert rows["strict"].state == "failed" and rows["strict"].last_status == 410
    assert rows["down"].state == "failed" and "gave up after 3600s" in rows["down"].last_error
    assert "ConnectError" in rows["down"].last_error  # the last cause is kept


def test_a_retried_dead_letter_is_delivered_and_its_age_restarts(
        sessionmaker: sessionmaker[Session]):
    rx = WebhookReceiver(script=[400])
    clock = Clock()
    with rx:
        url = rx.url
        tgt = WebhookTarget(name="t", url=url)
        with sessionmaker.begin() as s:
            (row,) = enqueue(s, note(1), [tgt])
            row_id = row.id
        with Deliverer(sessionmaker, [tgt], clock=clock, max_age_s=3600) as d:
            assert d.run_once().failed == 1
            clock.advance(7200)  # older than the max age: a retry still gets its chance
            with sessionmaker.begin() as s:
                assert retry_dead(s, row_id, clock.now).state == "pending"
            assert d.run_once().delivered == 1
    assert rx.accepted == {"tw-alert-1-firing": 1}
    with sessionmaker.begin() as s, pytest.raises(ValueError, match="delivered"):
        retry_dead(s, row_id, clock.now)
