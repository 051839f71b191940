"""The weekly report's Webhook dead letters section: the week's given-up notifications."""

from __future__ import annotations

from datetime import UTC, datetime

from monitor.report import build_report, load_registry, render_markdown
from monitor.report.html import render_html
from monitor.settings import Settings
from storage.models import WebhookDelivery

NOW = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)  # report of 2026-W48: Nov 23 .. Nov 30


def _row(target: str, key: str, at: datetime, state: str, error: str | None) -> WebhookDelivery:
    return WebhookDelivery(target=target, url="http://127.0.0.1:9/hook", format="generic",
                           payload={"k": key}, idempotency_key=key, state=state, created_at=at,
                           next_attempt_at=at, attempts=1, last_error=error)


def test_dead_letters_section_counts_per_target_with_oldest_and_reason(
        sessionmaker, report_settings: Settings) -> None:
    gone = "gave up after 86400s (9 attempts); last: timeout after 5s: ReadTimeout"
    with sessionmaker.begin() as s:
        s.add_all([
            _row("pager", "a1", datetime(2026, 11, 24, 9, 30, tzinfo=UTC), "failed",
                 "HTTP 404: no such hook"),
            _row("pager", "a2", datetime(2026, 11, 26, 9, tzinfo=UTC), "failed",
                 "HTTP 404: no such hook"),
            _row("pager", "a3", datetime(2026, 11, 27, 9, tzinfo=UTC), "failed", gone),
            _row("pager", "a4", datetime(2026, 11, 27, 10, tzinfo=UTC), "delivered", None),
            _row("pager", "a5", datetime(2026, 11, 20, 9, tzinfo=UTC), "failed",  # W47
                 "HTTP 410: gone"),
            _row("chat", "b1", datetime(2026, 11, 29, 23, tzinfo=UTC), "failed", gone),
            _row("chat", "b2", datetime(2026, 11, 29, 23, 5, tzinfo=UTC), "pending", None),
        ])
    with sessionmaker.begin() as s:
        report = build_report(s, "2026-W48", NOW, load_registry(), report_settings)
    rows = report.data.dead_letters
    assert [(r.target, r.count, r.reason, r.other_reasons) for r in rows] == [
        ("pager", 3, "HTTP 404: no such hook", 1), ("chat", 1, gone, 0)]
    assert rows[0].oldest.replace(tzinfo=UTC) == datetime(2026, 11, 24, 9, 30, tzinfo=UTC)
    section = render_markdown(report).split("## Webhook dead letters", 1)[1].split("##", 1)[0]
    assert "| pager | 3 | 2026-11-24 09:30 | HTTP 404: no such hook (+1 other reasons) |" \
        in section
    assert "| chat | 1 | 2026-11-29 23:00 |" in section
    assert "/v1/deliveries?state=dead" in section
    assert "HTTP 410" not in section  # last week's
    html = render_html(report)
    assert "<h2>Webhook dead letters</h2>" in html and "no such hook" in html
    assert report.summary()["dead_letters"] == {"pager": 3, "chat": 1}


def test_a_week_without_dead_letters_says_so(sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as s:
        s.add(_row("pager", "ok", datetime(2026, 11, 24, 9, tzinfo=UTC), "delivered", None))
    with sessionmaker.begin() as s:
        report = build_report(s, "2026-W48", NOW, load_registry(), report_settings)
    assert report.data.dead_letters == ()
    section = render_markdown(report).split("## Webhook dead letters", 1)[1].split("##", 1)[0]
    assert "No dead letters" in section
    assert report.summary()["dead_letters"] == {}


def test_hand_built_delivery_rows_carry_what_the_outbox_writes(sessionmaker) -> None:
    # The rows above are built by hand (each dead letter would otherwise need a receiver
    # failing its own way); they must have the shape alerts.outbox.enqueue writes.
    from alerts.outbox import enqueue_message
    from alerts.webhooks import WebhookTarget
    from storage.models import DELIVERY_STATES

    with sessionmaker.begin() as s:
        (written,) = enqueue_message(s, "title", "text",
                                     [WebhookTarget("pager", "http://127.0.0.1:9/hook")],
                                     now=NOW, key="k1")
        built = _row("pager", "a1", NOW, "failed", "HTTP 404: no such hook")
        s.add(built)
        s.flush()
        columns = [c.key for c in WebhookDelivery.__table__.columns]
        set_by_writer = {c for c in columns if getattr(written, c) is not None}
        set_by_hand = {c for c in columns if getattr(built, c) is not None}
        assert set_by_writer <= set_by_hand
        assert set_by_hand - set_by_writer <= {"last_error"}  # the delivery loop's, on failure
        for c in set_by_writer:
            assert type(getattr(built, c)) is type(getattr(written, c)), c
        assert built.state in DELIVERY_STATES and built.format == written.format
