"""Alert lifecycle: pending -> firing -> resolved, one open alert per fingerprint.

A rule result for a scope moves that scope's alert:
    (none)  --breaching-->  pending  --fired-->  firing  --recovered-->  resolved
    pending --back inside threshold before confirmation--> resolved (never notified)
    pending --fired, but its latest cycles no longer breach--> resolved, recorded as a
            "late" transition (RuleResult.over): the cause has ended, nobody is paged
            (no fired_at: it never fired; the detector restarts after it all the same,
            storage.queries.alerts.confirmed_run)
Every move is an `AlertTransition` row with the value, baseline and relative change;
firing and resolved moves add outbox rows in the same transaction (per alert; the
evaluator instead groups them into incidents, `alerts.incidents`, and notifies once per
incident). Empty windows move nothing (no data is not recovery; a series that stays
empty while the rule's other series report is retired by the evaluator).

No flapping: the detector of a scope restarts from zero when its alert fires and when a
fired alert resolves (`detector_start`: the evaluator only hands the rule the cycles
after that moment). Recovery is then judged on post-firing cycles only, and the run that
fired an alert cannot fire it again after it resolves: re-firing needs a new confirmed run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from alerts.outbox import enqueue, notification_key
from alerts.rules import Rule, RuleResult
from alerts.webhooks import AlertInfo, Notification, WebhookTarget
from storage.models import Alert, AlertTransition, scope_key
from storage.queries import alerts as queries


def fingerprint(rule: str, labels: Mapping[str, str]) -> str:
    """Return the dedup key of an alert: a hash of the rule name and its labels."""
    return hashlib.sha256(f"{rule}\x1f{scope_key(labels)}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Transition:
    """One state change made by an evaluation."""

    alert_id: int
    rule: str
    labels: Mapping[str, str]
    from_state: str | None
    to_state: str
    reason: str


def open_alerts(session: Session) -> dict[str, Alert]:
    """Return fingerprint -> the alert that is pending or firing."""
    return {a.fingerprint: a for a in queries.open_alerts(session)}


def detector_start(alert: Alert | None, last_resolved: datetime | None,
                   window_s: float) -> datetime | None:
    """Return the start of the first cycle the detector may read for a scope (None: any).

    A firing alert reads the cycles from its firing on; otherwise the cycles after the
    scope's last fired alert resolved. A pending alert keeps its run: pending moves do not
    restart the detector, or noisy cycles inside a real shift would keep resetting it.
    """
    if alert is not None and alert.state == "firing" and alert.fired_at is not None:
        at: datetime | None = alert.fired_at
    else:
        at = last_resolved
    if at is None:
        return None
    ts = at.timestamp()
    # The cycle holding the transition was unfinished then: it is the first new one.
    return datetime.fromtimestamp(ts - ts % window_s, UTC)


def alert_info(alert: Alert) -> AlertInfo:
    """Return what formatters need to know about `alert`."""
    return AlertInfo(
        alert_id=alert.id, rule=alert.rule, fingerprint=alert.fingerprint,
        labels=dict(alert.labels or {}), annotations=dict(alert.annotations or {}),
        severity=alert.severity, status="resolved" if alert.state == "resolved" else "firing",
        starts_at=alert.fired_at or alert.started_at, ends_at=alert.resolved_at,
        value=alert.value, baseline=alert.baseline, relative_change=alert.relative_change,
        threshold=alert.threshold)


class Lifecycle:
    """Apply rule results to stored alerts and queue their notifications."""

    def __init__(self, session: Session, now: datetime, targets: Sequence[WebhookTarget] = (),
                 *, external_url: str = "", resend_s: float = 120.0,
                 per_alert: bool = True) -> None:
        self.session = session
        self.now = now
        self.targets = list(targets)
        self.external_url = external_url
        self.resend_s = resend_s
        # False: notifications are the incidents' (alerts.incidents reads fired/resolved).
        self.per_alert = per_alert
        self.notifications = 0
        self.fired: list[Alert] = []
        self.resolved: list[Alert] = []

    def apply(self, rule: Rule, result: RuleResult, alert: Alert | None) -> list[Transition]:
        """Move `alert` (None: no open alert for this scope) according to `result`."""
        out: list[Transition] = []
        if result.no_data:
            return out
        if alert is None:
            if not (result.fired or result.breaching):
                return out
            alert = Alert(
                fingerprint=fingerprint(rule.name, result.labels), rule=rule.name,
                labels=dict(result.labels), severity=result.severity, state="pending",
                started_at=self.now, updated_at=self.now, consecutive_breaches=0,
                consecutive_ok=0)
            self.session.add(alert)
            self.session.flush()
            out.append(self._move(alert, None, "pending", result))
        self._update(rule, alert, result)
        if alert.state == "pending":
            if result.fired and result.over:
                # Confirmed only after its cause ended: it never fires (no fired_at, so
                # the report lists it as late, not fired); the late transition restarts
                # the detector after this run, so it is not judged again.
                alert.resolved_at = self.now
                out.append(self._move(alert, "pending", "late", result, state="resolved"))
            elif result.fired:
                alert.fired_at = self.now
                # The result's: a series too young to state its false pages fires a warning.
                alert.severity = result.severity
                out.append(self._move(alert, "pending", "firing", result))
                self._notify(alert, out[-1])
            elif not result.breaching:
                alert.resolved_at = self.now
                out.append(self._move(alert, "pending", "resolved", result,
                                      "not confirmed: back within threshold"))
        elif alert.state == "firing":
            if result.recovered:
                alert.resolved_at = self.now
                out.append(self._move(alert, "firing", "resolved", result,
                                      f"recovered for {rule.resolve_for} cycles: {result.reason}"))
                self._notify(alert, out[-1])
            else:
                self._resend(alert)
        return out

    def retire(self, alert: Alert, reason: str) -> Transition:
        """Resolve an open alert its rule cannot judge any more (notified if it was firing).

        Used when the rule is no longer configured, when the alert's instance went stale
        (stopped reporting: restarted under another name, or gone) and when its series
        is gone while the rule's others report (`alerts.evaluator.series_gone`).
        """
        was = alert.state
        alert.resolved_at = self.now
        alert.updated_at = self.now
        alert.state = "resolved"
        self.session.add(AlertTransition(alert_id=alert.id, at=self.now, from_state=was,
                                         to_state="resolved", value=alert.value,
                                         baseline=alert.baseline,
                                         relative_change=alert.relative_change, reason=reason))
        self.session.flush()
        t = Transition(alert.id, alert.rule, dict(alert.labels), was, "resolved", reason)
        if was == "firing":
            self._notify(alert, t)
        return t

    def _update(self, rule: Rule, alert: Alert, r: RuleResult) -> None:
        alert.value = r.current
        alert.baseline = r.baseline
        alert.relative_change = r.relative_change
        alert.threshold = r.threshold
        alert.updated_at = self.now
        alert.consecutive_breaches = alert.consecutive_breaches + 1 if r.breaching else 0
        alert.consecutive_ok = 0 if r.breaching else alert.consecutive_ok + 1
        where = ", ".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "all"
        change = f" {r.relative_change:+.1%} vs baseline" if r.relative_change is not None else ""
        alert.annotations = {
            "summary": f"{rule.metric} ({rule.source}, {where}){change}",
            "description": (rule.description + " " if rule.description else "") + r.reason,
            "metric": rule.metric, "source": rule.source,
            "value": "" if r.current is None else f"{r.current:.6g}",
            "baseline": "" if r.baseline is None else f"{r.baseline:.6g}",
        }

    def _move(self, alert: Alert, old: str | None, new: str, r: RuleResult,
              reason: str | None = None, *, state: str | None = None) -> Transition:
        alert.state = state or new
        why = reason or r.reason
        self.session.add(AlertTransition(
            alert_id=alert.id, at=self.now, from_state=old, to_state=new, value=r.current,
            baseline=r.baseline, relative_change=r.relative_change, reason=why))
        self.session.flush()
        return Transition(alert.id, alert.rule, dict(alert.labels), old, new, why)

    def _notify(self, alert: Alert, t: Transition, targets: Sequence[WebhookTarget] | None = None,
                key: str | None = None) -> None:
        if t.to_state == "firing" and t.from_state != "firing":
            self.fired.append(alert)
        elif t.to_state == "resolved":
            self.resolved.append(alert)
        if not self.per_alert:
            return
        info = alert_info(alert)
        where = ", ".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "all"
        title = f"{alert.rule} ({where}) {info.status}"
        n = Notification(key=key or notification_key("alert", alert.fingerprint, alert.id,
                                                     t.to_state),
                         title=title, text=info.annotations.get("description", t.reason),
                         at=self.now, alert=info)
        rows = enqueue(self.session, n, self.targets if targets is None else targets,
                       external_url=self.external_url, alert_id=alert.id)
        self.notifications += len(rows)
        alert.last_notified_at = self.now

    def _resend(self, alert: Alert) -> None:
        if not self.per_alert:
            return  # the incident re-sends its members (alerts.incidents)
        # Alertmanager resolves a pushed alert after resolve_timeout unless it is re-sent.
        api = [t for t in self.targets if t.format == "alertmanager_api"]
        last = alert.last_notified_at
        if not api or (last is not None and self.now - last < timedelta(seconds=self.resend_s)):
            return
        t = Transition(alert.id, alert.rule, dict(alert.labels), "firing", "firing", "re-sent")
        self._notify(alert, t, api, notification_key("resend", alert.fingerprint, alert.id,
                                                      self.now.isoformat()))
