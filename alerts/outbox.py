"""The webhook outbox: notifications written with the transition, delivered later.

`enqueue_alert` / `enqueue_message` add `WebhookDelivery` rows (one per target) in the
caller's transaction, so a notification exists exactly when its cause was committed.
`Deliverer.run_once()` delivers the due rows, each target on its own thread:

1. expire: due rows older than the max age become dead letters (state "failed");
2. claim, per target: in a short transaction, select due rows (FOR UPDATE SKIP LOCKED
   on PostgreSQL, so two replicas never claim the same row; SQLite has one writer) and
   push their next_attempt_at forward by a lease;
3. send each outside any transaction (a slow receiver never holds a DB lock), in order
   per alert fingerprint;
4. record: delivered, dead letter (4xx other than 408/429: retrying cannot help; listed
   and retryable by hand, see `retry_dead`) or retry with exponential backoff and jitter
   (timeouts, connection errors, 5xx, 408, 429). An answer resets the target's backoff.

State lives in SQL, so a restarted Deliverer resumes where the last one stopped. A crash
between sending and recording re-sends after the lease: delivery is at-least-once (as
Alertmanager's), and the Idempotency-Key header lets receivers drop the duplicate.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from alerts.webhooks import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    Notification,
    WebhookTarget,
    body_bytes,
    format_payload,
    payload_status,
    signature,
)
from storage.db import reading
from storage.models import WebhookDelivery
from storage.queries import deliveries
from vocab import utcnow

log = logging.getLogger(__name__)
Clock = Callable[[], datetime]
_RETRY_4XX = (408, 429)


def notification_key(*parts: object) -> str:
    """Return a stable idempotency key for a notification identified by `parts`."""
    return "tw-" + hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:32]


def enqueue(session: Session, notification: Notification, targets: Iterable[WebhookTarget], *,
            external_url: str = "", alert_id: int | None = None) -> list[WebhookDelivery]:
    """Add one outbox row per target for `notification` (skips rows that already exist)."""
    rows = []
    for t in targets:
        if notification.alert is None and not t.messages:
            continue
        if deliveries.delivery_exists(session, t.name, notification.key):
            continue
        row = WebhookDelivery(
            target=t.name, url=t.url, format=t.format,
            payload=format_payload(t, notification, external_url=external_url),
            idempotency_key=notification.key, alert_id=alert_id, attempts=0,
            next_attempt_at=notification.at, state="pending", created_at=notification.at)
        session.add(row)
        rows.append(row)
    session.flush()
    return rows


def enqueue_message(session: Session, title: str, text: str,
                    targets: Iterable[WebhookTarget], *, now: datetime | None = None,
                    key: str | None = None, labels: Mapping[str, str] | None = None,
                    external_url: str = "") -> list[WebhookDelivery]:
    """Queue a plain message (e.g. the weekly report summary) to every target that takes them.

    `key` makes repeated calls idempotent (e.g. "report-2026-W48"); by default the key
    derives from the title, text and time.
    """
    if not title or not title.strip():
        raise ValueError("title: must not be empty")
    now = now or utcnow()
    n = Notification(key=key or notification_key("message", title, text, now.isoformat()),
                     title=title, text=text, at=now, labels=dict(labels or {}))
    return enqueue(session, n, targets, external_url=external_url)


DEAD = "failed"  # the stored state of a dead letter ("dead" in the API and the metric)
SUPERSEDED = "superseded"


@dataclass(frozen=True)
class DeliveryReport:
    """What one run_once did."""

    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    failed: int = 0  # dead letters made: a 4xx answer, or older than the max age
    superseded: int = 0  # firings never delivered, replaced by their resolved
    deferred: int = 0  # not sent: their target is down, or an older one goes first
    dead_targets: tuple[str, ...] = ()  # the target of each dead letter, for the counter


@dataclass(frozen=True)
class _Claim:
    id: int
    target: str
    format: str
    payload: Any
    key: str
    attempts: int
    fingerprint: str | None  # the alert's; None for a plain message (no order to keep)
    created_at: datetime

    @property
    def status(self) -> str:
        return payload_status(self.format, self.payload) if self.fingerprint else "message"


class _Tally:
    """The counts of one run, added to from the per-target threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._dead: list[str] = []

    def add(self, outcome: str, n: int = 1, target: str | None = None) -> None:
        with self._lock:
            self._counts[outcome] += n
            if outcome == "failed" and target is not None:
                self._dead.extend([target] * n)

    def merge(self, other: _Tally) -> None:
        with other._lock:
            counts, dead = Counter(other._counts), list(other._dead)
        with self._lock:
            self._counts.update(counts)
            self._dead.extend(dead)

    def report(self) -> DeliveryReport:
        with self._lock:
            c = self._counts
            return DeliveryReport(c["claimed"], c["delivered"], c["retried"], c["failed"],
                                  c["superseded"], c["deferred"], tuple(self._dead))


class Deliverer:
    """Deliver due outbox rows, each target on its own thread; safe in several replicas.

    Per run: rows older than `max_age_s` become dead letters; then every target with due
    rows is drained concurrently (at most `parallel` at once), oldest first, so a hanging
    target costs only its own thread (and, past `run_wait_s`, not even the run). Per target:
      - the first timeout, connection error, 5xx, 408 or 429 ends that target's run: its
        other rows wait with it (one timeout per run, not one per row);
      - an answer (2xx, or a 4xx dead letter) resets the target's backoff: every row of
        it waiting is due now and is sent in the same run (up to `drain_max` rows);
      - per alert fingerprint, notifications go in order: a row waits while an older one
        of the same alert is pending, except a resolved whose older rows are firings
        never delivered: those are marked superseded and the resolved goes instead.

    Example:
        deliverer = Deliverer(sessions, parse_targets(settings.alerts.webhooks))
        deliverer.run_once()   # the scheduler calls this every few seconds
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        targets: Sequence[WebhookTarget],
        *,
        transport: httpx.BaseTransport | None = None,
        clock: Clock = utcnow,
        rng: random.Random | None = None,
        batch: int = 50,
        lease_s: float = 120.0,
        backoff_base_s: float = 2.0,
        backoff_max_s: float = 900.0,
        max_age_s: float = 86400.0,
        parallel: int = 8,
        drain_max: int = 500,
        run_wait_s: float | None = None,
    ) -> None:
        self.sessions = sessions
        self.targets = {t.name: t for t in targets}
        self.clock = clock
        self.rng = rng or random.Random()
        self.batch = batch
        self.lease_s = lease_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_age_s = max_age_s
        self.parallel = parallel
        self.drain_max = drain_max
        self.run_wait_s = run_wait_s
        self._rng_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="webhooks")
        # target -> its drain still running after its run returned (a hanging receiver)
        self._running: dict[str, tuple[Future[None], _Tally]] = {}
        self._running_lock = threading.Lock()
        self._client = httpx.Client(transport=transport, follow_redirects=False,
                                    headers={"User-Agent": "tailwatch-webhooks"},
                                    limits=httpx.Limits(max_connections=4 * parallel))

    def close(self) -> None:
        """Stop the delivery threads (without waiting for a hung receiver) and the client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> Deliverer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def backoff_s(self, attempts: int) -> float:
        """Return the wait before attempt `attempts + 1`: capped doubling, jittered 50-100%."""
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** max(0, attempts - 1))
        with self._rng_lock:
            return delay * (0.5 + 0.5 * self.rng.random())

    def claim(self, target: str | None = None) -> list[_Claim]:
        """Lease up to `batch` due rows (of `target`, or any) to this deliverer, oldest first."""
        now = self.clock()
        with self.sessions.begin() as session:
            rows = deliveries.due_rows(session, now, self.batch, target)
            lease = now + timedelta(seconds=self.lease_s)
            out = []
            for r, fp in rows:
                r.next_attempt_at = lease
                out.append(_Claim(r.id, r.target, r.format, r.payload, r.idempotency_key,
                                  r.attempts, fp if r.alert_id is not None else None,
                                  r.created_at))
            return out

    def due_targets(self) -> list[str]:
        """Return the targets that have due rows."""
        now = self.clock()
        with reading(self.sessions) as session:
            return deliveries.due_targets(session, now)

    def expire(self) -> list[str]:
        """Make due rows older than max_age_s dead letters; return their targets."""
        now = self.clock()
        cutoff = now - timedelta(seconds=self.max_age_s)
        with self.sessions.begin() as session:
            rows = deliveries.expired_rows(session, now, cutoff)
            for r in rows:
                r.state = DEAD
                r.last_error = (f"gave up after {self.max_age_s:g}s ({r.attempts} attempts)"
                                + (f"; last: {r.last_error}" if r.last_error else ""))[:2000]
                log.warning("webhook %s row %d: dead letter: %s", r.target, r.id, r.last_error)
            return [r.target for r in rows]

    def run_once(self) -> DeliveryReport:
        """Expire old rows, drain every target with due rows concurrently; return counts.

        Waits for the drains it starts, at most `run_wait_s` (None: until all end). A drain
        still running then (a hanging receiver) goes on in its thread; later runs skip its
        target until it ends and report its counts then, so it delays no other target.
        """
        tally = _Tally()
        for target in self.expire():
            tally.add("failed", target=target)
        started: dict[str, tuple[Future[None], _Tally]] = {}
        with self._running_lock:
            for target, (future, own) in list(self._running.items()):
                if future.done():
                    del self._running[target]
                    started[target] = (future, own)  # ended since the last run: report it
            busy = set(self._running)
            for target in self.due_targets():
                if target in busy or target in started:
                    continue
                own = _Tally()
                started[target] = (self._pool.submit(self._drain, target, own), own)
        wait([f for f, _ in started.values()], timeout=self.run_wait_s)
        errors: list[BaseException] = []
        with self._running_lock:
            for target, (future, own) in started.items():
                if not future.done():
                    self._running[target] = (future, own)
                    continue
                tally.merge(own)
                exc = future.exception()
                if exc is not None:
                    errors.append(exc)
        if errors:
            raise errors[0]  # e.g. the database is down: the job logs it, rows stay pending
        return tally.report()

    def _drain(self, target: str, tally: _Tally) -> None:
        sent = 0
        reset_done = False
        while sent < self.drain_max:
            claims = self.claim(target)
            if not claims:
                return
            tally.add("claimed", len(claims))
            reset = False
            for i, c in enumerate(claims):
                outcome = self._deliver_in_order(c, tally)
                if outcome == "retry":
                    # The target is down: its other rows wait with it rather than each
                    # costing a timeout; they are not attempts.
                    rest = claims[i + 1:]
                    self._defer([r.id for r in rest], self._next_attempt(c.id))
                    tally.add("deferred", len(rest))
                    return
                if outcome in ("delivered", "failed") and not reset_done:
                    reset_done = True
                    reset = self._reset_backoff(target, [r.id for r in claims[i + 1:]]) > 0
            sent += len(claims)
            if not reset and len(claims) < self.batch:
                return

    def _deliver_in_order(self, c: _Claim, tally: _Tally) -> str:
        if c.fingerprint is not None:
            older = self._older_pending(c)
            if older and c.status == "resolved" and all(
                    payload_status(fmt, p) == "firing" for _, fmt, p, _ in older):
                self._supersede([o[0] for o in older], c)
                tally.add("superseded", len(older))
            elif older:
                self._defer([c.id], max(o[3] for o in older))
                tally.add("deferred")
                return "deferred"
        outcome = self._deliver(c)
        tally.add(outcome if outcome != "retry" else "retried", target=c.target)
        return outcome

    def _older_pending(self, c: _Claim) -> list[tuple[int, str, Any, datetime]]:
        with reading(self.sessions) as session:
            assert c.fingerprint is not None
            return deliveries.older_pending(session, c.target, c.fingerprint, c.created_at, c.id)

    def _supersede(self, ids: list[int], by: _Claim) -> None:
        with self.sessions.begin() as session:
            for row in deliveries.pending_rows(session, ids):
                row.state = SUPERSEDED
                row.last_error = (f"superseded by resolved row {by.id}: never delivered "
                                  f"({row.attempts} attempts)")
                log.info("webhook %s row %d: %s", row.target, row.id, row.last_error)

    def _defer(self, ids: list[int], until: datetime) -> None:
        if not ids:
            return
        with self.sessions.begin() as session:
            session.execute(update(WebhookDelivery)
                            .where(WebhookDelivery.id.in_(ids), WebhookDelivery.state == "pending")
                            .values(next_attempt_at=until))

    def _next_attempt(self, row_id: int) -> datetime:
        with reading(self.sessions) as session:
            at = deliveries.next_attempt_at(session, row_id)
        return at or self.clock()

    def _reset_backoff(self, target: str, keep: list[int]) -> int:
        """Make every waiting row of `target` due now (it answered); return how many."""
        now = self.clock()
        with self.sessions.begin() as session:
            q = (update(WebhookDelivery)
                 .where(WebhookDelivery.target == target, WebhookDelivery.state == "pending",
                        WebhookDelivery.next_attempt_at > now)
                 .values(next_attempt_at=now))
            if keep:  # rows of this batch still to send: leased to us, not waiting
                q = q.where(WebhookDelivery.id.not_in(keep))
            n = int(session.execute(q).rowcount or 0)  # type: ignore[attr-defined]
        if n:
            log.info("webhook %s answered: %d waiting rows are due now", target, n)
        return n

    def _deliver(self, c: _Claim) -> str:
        target = self.targets.get(c.target)
        status: int | None = None
        if target is None:
            outcome, error = "retry", f"target {c.target!r} is not configured (kept for later)"
        else:
            body = body_bytes(c.payload)
            headers = {"Content-Type": "application/json", IDEMPOTENCY_HEADER: c.key,
                       **target.headers}
            if target.secret:
                headers[SIGNATURE_HEADER] = signature(target.secret, body)
            try:
                resp = self._client.post(target.url, content=body, headers=headers,
                                         timeout=target.timeout_s)
                status = resp.status_code
                if 200 <= status < 300:
                    outcome, error = "delivered", None
                elif 400 <= status < 500 and status not in _RETRY_4XX:
                    outcome, error = "failed", f"HTTP {status}: {resp.text[:200]}"
                else:
                    outcome, error = "retry", f"HTTP {status}: {resp.text[:200]}"
            except httpx.TimeoutException as e:
                outcome, error = "retry", f"timeout after {target.timeout_s:g}s: {type(e).__name__}"
            except httpx.TransportError as e:
                outcome, error = "retry", f"{type(e).__name__}: {e}"
        self._record(c, outcome, status, error)
        if outcome == "failed":
            log.warning("webhook %s row %d: dead letter (retry with POST /v1/deliveries/%d/retry):"
                        " %s", c.target, c.id, c.id, error)
        elif outcome != "delivered":
            log.warning("webhook %s row %d: %s", c.target, c.id, error)
        return outcome

    def _record(self, c: _Claim, outcome: str, status: int | None, error: str | None) -> None:
        now = self.clock()
        with self.sessions.begin() as session:
            row = session.get(WebhookDelivery, c.id)
            if row is None or row.state != "pending":
                return
            row.attempts = c.attempts + 1
            row.last_status = status
            row.last_error = error
            if outcome == "delivered":
                row.state = "delivered"
                row.delivered_at = now
            elif outcome == "failed":
                row.state = DEAD
            else:
                row.next_attempt_at = now + timedelta(seconds=self.backoff_s(row.attempts))


def retry_dead(session: Session, row_id: int, now: datetime) -> WebhookDelivery:
    """Queue a dead letter (or superseded row) again, due now; its max age restarts.

    Raises:
        LookupError: no such row.
        ValueError: the row is pending or delivered (nothing to retry).
    """
    row = session.get(WebhookDelivery, row_id)
    if row is None:
        raise LookupError(f"delivery {row_id} does not exist")
    if row.state not in (DEAD, SUPERSEDED):
        raise ValueError(f"id: delivery {row_id} is {row.state}, only dead or superseded "
                         "rows can be retried")
    row.state = "pending"
    row.next_attempt_at = now
    row.retried_at = now
    session.flush()
    return row


