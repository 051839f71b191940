"""The report's "Webhook dead letters" section: notifications of the week nobody received.

A dead letter is an outbox row given up on: its target answered 4xx, or it stayed
undelivered past `alerts.webhook_max_age_s`. One row per target: how many of the week's
notifications are dead now, the oldest, and the most frequent reason
(storage.queries.deliveries.dead_letter_reasons). Each can be retried by hand:
`GET /v1/deliveries?state=dead` lists them, `POST /v1/deliveries/{id}/retry` queues one again.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from sqlalchemy.orm import Session

from monitor.report.data import DeadLetterRow
from monitor.report.tables import Table
from storage.queries import deliveries as queries

DEAD_LETTER_HOWTO = ("List them with `GET /v1/deliveries?state=dead`; queue one again with "
                     "`POST /v1/deliveries/{id}/retry`.")
_REASON_CHARS = 160  # a receiver's 4xx body is quoted in the reason; keep the cell short


def collect_dead_letters(session: Session, start: datetime,
                         end: datetime) -> tuple[DeadLetterRow, ...]:
    """Return one row per target with dead letters created within [start, end), most first."""
    by_target: dict[str, list[tuple[str, int, datetime]]] = defaultdict(list)
    for target, reason, count, oldest in queries.dead_letter_reasons(session, start, end):
        by_target[target].append((reason or "no reason recorded", count, oldest))
    rows = []
    for target, reasons in by_target.items():
        reason, _, _ = max(reasons, key=lambda r: (r[1], -r[2].timestamp()))
        rows.append(DeadLetterRow(target, sum(n for _, n, _ in reasons),
                                  min(at for _, _, at in reasons), reason, len(reasons) - 1))
    return tuple(sorted(rows, key=lambda r: (-r.count, r.target)))


def dead_letter_table(rows: tuple[DeadLetterRow, ...]) -> Table:
    """Return the Webhook dead letters table."""
    out = [(r.target, str(r.count), r.oldest.strftime("%Y-%m-%d %H:%M"),
            _short(r.reason) + (f" (+{r.other_reasons} other reasons)" if r.other_reasons
                                else "")) for r in rows]
    return Table(("Target", "Dead letters", "Oldest (UTC)", "Reason (most frequent)"),
                 tuple(out), "No dead letters: every notification of the week was delivered "
                 "or is still being retried.")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 1] + "…"
