"""An open alert whose series stopped getting samples while the rule's others report."""

from __future__ import annotations

import random
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage.models import Alert, AlertTransition, WebhookDelivery
from tests.alerts.builders import add_cycle
from tests.alerts.test_evaluator import fill, minute, run


def only_bucket_16(sm: sessionmaker[Session], start: int, stop: int) -> None:
    """Add cycles measuring bucket 16 alone (bucket 64's series is gone)."""
    rng = random.Random(start)
    with sm.begin() as s:
        for i in range(start, stop):
            add_cycle(s, minute(i) + timedelta(seconds=2), {"16": 0.05 * (1 + rng.gauss(0, 0.02))})


def fire_in_bucket_64(sm: sessionmaker[Session]) -> None:
    fill(sm, 0, 40, 0.1)
    run(sm, 40)
    fill(sm, 40, 43, 0.2)
    for i in range(41, 44):
        run(sm, i)
    with sm() as s:
        (alert,) = s.scalars(select(Alert)).all()
        assert (alert.labels, alert.state) == ({"bucket": "64"}, "firing")


def test_firing_alert_of_a_gone_series_resolves_after_resolve_for_cycles(
        sessionmaker: sessionmaker[Session]):
    fire_in_bucket_64(sessionmaker)
    only_bucket_16(sessionmaker, 43, 50)
    # Cycles 43 and 44 empty: no data is no recovery, the alert stays firing.
    for i in (44, 45):
        assert run(sessionmaker, i).transitions == ()
    # The third empty cycle (RULE.resolve_for = 3) while bucket 16 kept reporting.
    (moved,) = run(sessionmaker, 46).transitions
    assert (moved.labels, moved.from_state, moved.to_state) == ({"bucket": "64"}, "firing",
                                                                 "resolved")
    assert moved.reason.startswith("series gone: no samples of its own since the cycle of "
                                   f"{minute(42).isoformat()}, 3 cycles")
    assert run(sessionmaker, 47).transitions == ()
    with sessionmaker() as s:
        (alert,) = s.scalars(select(Alert)).all()
        assert alert.state == "resolved"
        last = s.scalars(select(AlertTransition).order_by(AlertTransition.id.desc())).first()
        assert last is not None and last.reason.startswith("series gone")
        sent = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)).all()
        assert [d.payload["status"] for d in sent] == ["firing", "resolved"]


def test_alert_stays_open_while_every_series_is_empty(sessionmaker: sessionmaker[Session]):
    # The prober stopped (no cycles at all): nothing shows the series went away.
    fire_in_bucket_64(sessionmaker)
    for i in range(44, 52):
        assert run(sessionmaker, i).transitions == ()
    with sessionmaker() as s:
        assert s.scalars(select(Alert.state)).all() == ["firing"]


def test_a_series_back_within_resolve_for_cycles_is_judged_as_before(
        sessionmaker: sessionmaker[Session]):
    fire_in_bucket_64(sessionmaker)
    only_bucket_16(sessionmaker, 43, 45)
    fill(sessionmaker, 45, 47, 0.2)  # bucket 64 measured again, still slow
    for i in range(44, 48):
        assert run(sessionmaker, i).transitions == ()
    with sessionmaker() as s:
        assert s.scalars(select(Alert.state)).all() == ["firing"]
