"""Incidents: alerts that fire together in a shared scope, paged once with a probable cause.

An alert joins an incident when it fires (pending alerts are no incident's yet):
    - an open incident sharing its scope (an instance, or a cohort; an alert without an
      instance label covers every instance, so it shares any instance);
    - a resolved one that started within `window_s` and shares its scope, or one
      resolved within `hold_s` that it was a member of (same fingerprint): it reopens;
    - otherwise a new incident.
A cohort (model_version/config_hash) is read at grouping time: an instance's is the one
its latest canary cycle ran (`alerts.cohorts.ServingCohorts`), a rollout alert's
the new cohort it judged (its `new` label; it covers no instance of its own). So during
a rollout, alerts on two instances serving the new cohort share it.
Rule families (latency, speculation, compile, quality, memory, probes, traffic, load,
batching, rollout) are labels on the incident. It resolves when its last member resolves.

Notifications (one outbox row per target, order kept per incident through its first
member's alert id): firing once when it opens (or reopens), with its members, a summary
line and the probable cause (`alerts.cause`); at most one update per `group_interval_s`
while members join or leave, to the formats in `update_formats` (Alertmanager's by
default); escalated to every target when a page joins an incident notified as a warning
(or less): at once the first time, as a warning must never hide a page; de-escalated to
every target when its receivers were told of a page and no page member fires any more
while warnings go on (a pager resolves the page; the incident stays open). After the
first escalation, escalations and de-escalations go out at most once per
`group_interval_s` (a page member that flaps pages nobody every cycle): what is sent is
the severity in force when it is due. Resolved once. alertmanager_api targets get the
members re-sent every `resend_s` while it is open (Alertmanager resolves pushed alerts
not re-sent).

A newly opened incident whose cause is unknown for lack of evidence (no A/B pair measured
during it yet, or too few for a confidence interval: `awaits_evidence`) holds its firing, like Alertmanager's group_wait, until
the cause is measured or `cause_wait_s` has passed since it opened (a "held" event says
so); then it fires once with what is known and its members as of then. A reopen fires at
once. Held, it sends no update, resend or severity change (its receivers heard nothing);
resolved while held, it sends the firing (its cause as measured) and then the resolved.

The counter of incidents by cause counts each incident once (`counted_cause`): by the
first cause stated other than unknown, or the one it resolved with. A cause restated
later moves no count: a counter never goes down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from alerts.baselines import cohort_label
from alerts.cause import Cause, CauseConfig, Scope, measure
from alerts.cohorts import ServingCohorts
from alerts.lifecycle import Lifecycle, alert_info
from alerts.outbox import enqueue, notification_key
from alerts.rollout import ROLLOUT_RULE
from alerts.webhooks import IncidentInfo, Notification, WebhookTarget
from storage.models import Alert, Incident, IncidentEvent, IncidentMember
from storage.queries import incidents as queries

log = logging.getLogger(__name__)
SEVERITY_ORDER = ("page", "warning", "info")
# metric -> family; rules are labelled by their metric (rule names are the user's).
# queue_wait_share stays "load": a rising wait is requests queueing (alerts.cause reads the
# family as load); the batching family is what a fuller batch step costs.
FAMILIES = {
    "p50_latency": "latency", "p95_latency": "latency", "p99_latency": "latency",
    "ttft": "latency", "per_token": "latency", "burst_p99": "latency",
    "acceptance_rate": "speculation", "recompiles_per_hour": "compile",
    "compile_failures": "compile", "output_agreement": "quality", "memory_growth": "memory",
    "probe_failures": "probes", "overflow_share": "traffic", "padding_waste": "traffic",
    "rejections": "traffic", "queue_wait_share": "load", "batch_p99_ratio": "batching",
    "step_throughput": "batching",
}
# An instance's cohort is its latest canary cycle's within this long (cycles run every
# evaluation or so; an instance silent for longer serves no cohort we can name).
SERVING_LOOKBACK_S = 3600.0


@dataclass(frozen=True)
class IncidentConfig:
    """Grouping and notification timings (the `alerts.incidents` settings)."""

    window_s: float = 150.0  # about two evaluation cycles of 60 s
    hold_s: float = 600.0
    group_interval_s: float = 300.0
    update_formats: frozenset[str] = frozenset({"alertmanager", "alertmanager_api"})
    # A new incident with no A/B pair measured during it yet holds its firing this long
    # for the cause (0: off; the `alerts.incidents.cause_wait_s` setting ships 120).
    cause_wait_s: float = 0.0
    cause: CauseConfig = field(default_factory=CauseConfig)


@dataclass(frozen=True)
class IncidentReport:
    """What one evaluation did to incidents."""

    opened: tuple[int, ...] = ()
    reopened: tuple[int, ...] = ()
    resolved: tuple[int, ...] = ()
    notifications: int = 0


def family(alert: Alert) -> str:
    """Return the rule family of an alert (its metric's; "other" when unknown)."""
    metric = (alert.annotations or {}).get("metric", "")
    if alert.rule == ROLLOUT_RULE:
        return "rollout"
    return FAMILIES.get(metric, "other")


@dataclass(frozen=True)
class Reach:
    """Where alerts apply: instances, cohorts ("model_version/config_hash"), or everywhere."""

    instances: frozenset[str] = frozenset()
    cohorts: frozenset[str] = frozenset()
    everywhere: bool = False

    def __or__(self, other: Reach) -> Reach:
        """Return where either applies."""
        return Reach(self.instances | other.instances, self.cohorts | other.cohorts,
                     self.everywhere or other.everywhere)

    def shares(self, other: Reach) -> bool:
        """Return whether the two share an instance or a cohort (everywhere shares all)."""
        return (self.everywhere or other.everywhere or bool(self.instances & other.instances)
                or bool(self.cohorts & other.cohorts))


def reach(alert: Alert, serving: Mapping[str, str]) -> Reach:
    """Return where `alert` applies; `serving`: instance -> the cohort it serves now.

    A rollout alert judged a cohort, not an instance: it applies to that cohort (its `new`
    label). An alert with an instance label applies to the instance and its cohort; any
    other alert covers every instance.
    """
    labels = alert.labels or {}
    if alert.rule == ROLLOUT_RULE and labels.get("new"):
        return Reach(cohorts=frozenset({labels["new"]}))
    inst = labels.get("instance")
    if inst is None:
        return Reach(everywhere=True)
    cohort = serving.get(inst)
    return Reach(frozenset({inst}), frozenset({cohort}) if cohort else frozenset())


def _scope(members: Sequence[Alert], serving: Mapping[str, str],
           cohorts: Iterable[str] = ()) -> tuple[Scope, Reach]:
    """Return what `members` cover; `cohorts`: those the incident was stated with before
    (an instance that moved on to another cohort keeps its incident's)."""
    buckets = sorted({m.labels["bucket"] for m in members if "bucket" in (m.labels or {})})
    instances = sorted({m.labels["instance"] for m in members if "instance" in (m.labels or {})})
    where = Reach(cohorts=frozenset(cohorts))
    for m in members:
        where |= reach(m, serving)
    fams = sorted({family(m) for m in members})
    sources = sorted({(m.annotations or {}).get("source") or "" for m in members})
    return Scope(tuple(buckets), tuple(instances), tuple(fams), tuple(sources)), where


def summary(members: Sequence[Alert], scope: Scope, cohorts: Sequence[str],
            cause_text: str) -> str:
    """Return the incident's summary line: how many alerts, where, which families, why."""
    firing = sum(m.state == "firing" for m in members)
    where = [f"{len(scope.buckets)} bucket{'s' if len(scope.buckets) != 1 else ''}"
             + (f" ({', '.join(scope.buckets)})" if scope.buckets else "")]
    where.append("instances " + ", ".join(scope.instances) if scope.instances
                 else "all instances")
    if cohorts:
        where.append("cohorts " + ", ".join(cohorts))
    return (f"{len(members)} alert{'s' if len(members) != 1 else ''} ({firing} firing) "
            f"in {'; '.join(where)}; families {', '.join(scope.families)}; "
            f"probable cause: {cause_text}")


class Incidents:
    """Group one evaluation's fired and resolved alerts into incidents and notify them."""

    def __init__(self, session: Session, now: datetime, config: IncidentConfig,
                 life: Lifecycle, serving: ServingCohorts | None = None) -> None:
        self.session = session
        self.now = now
        self.config = config
        self.life = life
        self.notifications = 0
        horizon = now - timedelta(seconds=max(config.window_s, config.hold_s))
        self.candidates = queries.recent_incidents(session, horizon)
        self.members = queries.members_of(session, [i.id for i in self.candidates])
        self._cohorts = serving or ServingCohorts(session, now)
        self._serving: dict[str, str] | None = None

    def run(self) -> IncidentReport:
        """Join fired alerts, count resolved ones, then notify what changed."""
        opened: list[Incident] = []
        reopened: list[Incident] = []
        touched: dict[int, Incident] = {}
        joined: set[int] = set()
        for alert in sorted(self.life.fired, key=lambda a: a.id):
            inc, how = self._join(alert)
            touched[inc.id] = inc
            joined.add(inc.id)
            (opened if how == "opened" else reopened if how == "reopened" else []).append(inc)
        resolved_ids = {a.id for a in self.life.resolved}
        for inc in self.candidates:
            mine = [m for m in self.members.get(inc.id, []) if m.id in resolved_ids]
            for m in mine:
                self._event(inc, "left", m, f"{m.rule} resolved")
                touched[inc.id] = inc
        resolved: list[Incident] = []
        for inc in touched.values():
            members = self.members[inc.id]
            if inc.state == "open" and all(m.state == "resolved" for m in members):
                inc.state = "resolved"
                inc.resolved_at = self.now
                inc.updated_at = self.now
                self._event(inc, "resolved", None, "its last member resolved")
                resolved.append(inc)
            self._describe(inc, members, remeasure=inc.id in joined)
        for inc in self.candidates:
            # The A/B arms run in a share of the cycles only: a cause not measurable when
            # the incident opened is measured again while it is open (updates and the
            # resolved notification state it). A member leaving measures nothing: the
            # window would reach into the cycles after the cause ended.
            if inc.id not in joined and inc.state == "open" and inc.cause == "unknown":
                self._describe(inc, self.members.get(inc.id, []), remeasure=True)
        for inc in self.candidates:
            _count(inc)
            self._notify(inc, inc in opened or inc in reopened, inc in resolved)
        self.session.flush()
        return IncidentReport(tuple(i.id for i in opened), tuple(i.id for i in reopened),
                              tuple(i.id for i in resolved), self.notifications)

    def _join(self, alert: Alert) -> tuple[Incident, str]:
        window = timedelta(seconds=self.config.window_s)
        hold = timedelta(seconds=self.config.hold_s)
        best: tuple[Incident, str] | None = None
        mine = reach(alert, self.serving())
        for inc in reversed(self.candidates):
            members = self.members.get(inc.id, [])
            _, where = _scope(members, self.serving(), inc.cohorts or ())
            share = mine.shares(where)
            if inc.state == "open" and share:
                best = (inc, "joined")
                break
            was_member = any(m.fingerprint == alert.fingerprint for m in members)
            recent = inc.resolved_at is not None and self.now - inc.resolved_at <= hold
            if (share and self.now - inc.started_at <= window) or (was_member and recent):
                best = best or (inc, "reopened")
        if best is None:
            inc = Incident(state="open", started_at=self.now, updated_at=self.now,
                           severity=alert.severity, families=[], buckets=[], instances=[],
                           cohorts=[], summary="", cause="unknown", cause_text="",
                           evidence={}, reopened=0, notified_members=[])
            self.session.add(inc)
            self.session.flush()
            self.candidates.append(inc)
            self.members[inc.id] = []
            best = (inc, "opened")
        inc, how = best
        if how == "reopened":
            inc.state = "open"
            inc.resolved_at = None
            inc.reopened += 1
            self._event(inc, "reopened", alert, f"{alert.rule} fired again")
        self.session.add(IncidentMember(incident_id=inc.id, alert_id=alert.id, joined_at=self.now))
        self.members[inc.id].append(alert)
        self._event(inc, "opened" if how == "opened" else "joined", alert,
                    f"{alert.rule} {_where(alert)}")
        inc.updated_at = self.now
        if SEVERITY_ORDER.index(alert.severity if alert.severity in SEVERITY_ORDER else "info") \
                < SEVERITY_ORDER.index(inc.severity if inc.severity in SEVERITY_ORDER else "info"):
            inc.severity = alert.severity
        return inc, how

    def _describe(self, inc: Incident, members: Sequence[Alert], *, remeasure: bool) -> None:
        if not members:
            return
        scope, where = _scope(members, self.serving(), inc.cohorts or ())
        cohorts = sorted(where.cohorts)
        inc.families = list(scope.families)
        inc.buckets = list(scope.buckets)
        inc.instances = list(scope.instances)
        inc.cohorts = cohorts
        if remeasure and inc.state == "open":
            pending = [(m.rule, m.started_at) for m in members]
            try:
                with self.session.begin_nested():
                    cause = measure(self.session, scope, pending, self.now, self.config.cause)
            except Exception as e:  # noqa: BLE001 - a cause we cannot measure still pages
                log.exception("incident %d: cause not measured", inc.id)
                cause = Cause("unknown", f"unknown (not measured: {type(e).__name__})")
            inc.cause, inc.cause_text, inc.evidence = cause.kind, cause.text, dict(cause.evidence)
        inc.summary = summary(members, scope, cohorts, inc.cause_text)

    def serving(self) -> dict[str, str]:
        """Return instance -> the cohort it serves now ("model_version/config_hash")."""
        if self._serving is None:
            self._serving = {inst: cohort_label(c) for inst, c in
                             self._cohorts.within(SERVING_LOOKBACK_S).items()}
        return self._serving

    def _event(self, inc: Incident, kind: str, alert: Alert | None, detail: str) -> None:
        self.session.add(IncidentEvent(incident_id=inc.id, at=self.now, kind=kind,
                                       alert_id=alert.id if alert is not None else None,
                                       detail=detail))

    def _notify(self, inc: Incident, fire: bool, resolve: bool) -> None:
        members = self.members.get(inc.id, [])
        if not members or not self.life.targets:
            return
        # A firing held for the cause: it goes out once the cause is measured or the wait
        # is over, or before the resolved (receivers must hear of what resolved).
        held = not fire and self._held(inc)
        if (fire or held) and not resolve:
            if self._waits(inc):
                if fire:
                    self._event(inc, "held", None, "held: waiting for the cause up to "
                                                   f"{self.config.cause_wait_s:g} s")
                return
            fire = True
        elif held and resolve:
            self._send(inc, members, "firing", notification_key(
                "incident", inc.id, "firing", inc.reopened), self.life.targets,
                status="firing")
        # What receivers were last told: the members firing (a join or a leave changes it).
        ids = sorted(m.id for m in members if m.state == "firing")
        targets: Sequence[WebhookTarget] = ()
        change = None if resolve or fire else self._severity_change(inc, members)
        if resolve:
            kind, key, targets = "resolved", notification_key(
                "incident", inc.id, "resolved", inc.reopened), self.life.targets
        elif fire:
            kind, key, targets = "firing", notification_key(
                "incident", inc.id, "firing", inc.reopened), self.life.targets
        elif change is not None and change[0] == "escalated":
            # A page joined an incident its receivers heard of as a warning: every target
            # hears it, whatever the update settings (generic and slack get none).
            # After a de-escalation the same page may come back: a new key, not a duplicate.
            again = change[1]
            kind, key, targets = "escalated", notification_key(
                "incident", inc.id, "escalated", inc.severity, inc.reopened,
                *([again] if again else [])), self.life.targets
        elif change is not None:
            # The page is over but warnings it joined go on (a slow drift can hold them for
            # days): without this a pager stays triggered until the last warning resolves.
            kind, key, targets = "deescalated", notification_key(
                "incident", inc.id, "deescalated", self.now.isoformat()), self.life.targets
            self._event(inc, "deescalated", None,
                        f"no {inc.notified_severity} member firing; now {_now_severity(members)}")
        elif inc.state == "open" and self._due(inc, self.config.group_interval_s) \
                and ids != sorted(inc.notified_members or []):
            kind, key = "update", notification_key("incident", inc.id, "update",
                                                   self.now.isoformat())
            targets = [t for t in self.life.targets if t.format in self.config.update_formats]
        elif inc.state == "open" and self._due(inc, self.life.resend_s, resend=True):
            kind, key = "resend", notification_key("incident", inc.id, "resend",
                                                  self.now.isoformat())
            targets = [t for t in self.life.targets if t.format == "alertmanager_api"]
        if not targets:
            return
        self._send(inc, members, kind, key, targets)

    def _send(self, inc: Incident, members: Sequence[Alert], kind: str, key: str,
              targets: Sequence[WebhookTarget], status: str | None = None) -> None:
        ids = sorted(m.id for m in members if m.state == "firing")
        n = self._notification(inc, members, key, kind, status)
        rows = enqueue(self.session, n, targets, external_url=self.life.external_url,
                       alert_id=members[0].id)
        self.notifications += len(rows)
        self.life.notifications += len(rows)
        if kind == "resend":
            inc.last_resent_at = self.now
        else:
            inc.last_notified_at = self.now
            inc.notified_members = ids
            if kind != "resolved":
                inc.notified_severity = _now_severity(members) or inc.severity
        self._event(inc, "notified", None, key)

    def _waits(self, inc: Incident) -> bool:
        """Return whether the first firing of `inc` waits for its cause now."""
        wait = self.config.cause_wait_s
        return (wait > 0 and inc.reopened == 0 and inc.state == "open"
                and awaits_evidence(inc.cause, inc.evidence)
                and self.now - inc.started_at < timedelta(seconds=wait))

    def _held(self, inc: Incident) -> bool:
        """Return whether the first firing of `inc` was held and has not gone out yet."""
        # Not read from cause_wait_s: one held before a restart that turned it off still
        # goes out.
        return (inc.reopened == 0 and inc.last_notified_at is None
                and queries.event_count(self.session, inc.id, "held") > 0)

    def _severity_change(self, inc: Incident,
                         members: Sequence[Alert]) -> tuple[str, int] | None:
        """Return ("escalated" or "deescalated", the de-escalations sent so far) when one
        is due now, else None.

        The first escalation goes out at once: a warning must never hide the page that
        followed it. After that a page member that comes and goes would notify every
        target each time, so escalations and de-escalations wait for `group_interval_s`
        since the last notification; what goes out then is the severity in force (a page
        that came and went meanwhile sends nothing).
        """
        if inc.state != "open":
            return None
        up, down = _escalated(inc, members), _deescalated(inc, members)
        if not (up or down):
            return None
        again = queries.event_count(self.session, inc.id, "deescalated")
        if (up and not again) or self._due(inc, self.config.group_interval_s):
            return ("escalated" if up else "deescalated"), again
        return None

    def _due(self, inc: Incident, interval_s: float, *, resend: bool = False) -> bool:
        last = inc.last_notified_at
        if resend and inc.last_resent_at is not None and (last is None
                                                          or inc.last_resent_at > last):
            last = inc.last_resent_at
        return last is None or self.now - last >= timedelta(seconds=interval_s)

    def _notification(self, inc: Incident, members: Sequence[Alert], key: str,
                      kind: str, status: str | None = None) -> Notification:
        status = status or ("resolved" if inc.state == "resolved" else "firing")
        infos = tuple(alert_info(m) for m in members)
        # An escalation or de-escalation carries the severity now in force; the others the
        # incident's highest (a resolved one's, what it was).
        severity = (_now_severity(members) or inc.severity) if kind in (
            "escalated", "deescalated") else inc.severity
        info = IncidentInfo(
            incident_id=inc.id, status=status, kind=kind, summary=inc.summary,
            cause=inc.cause, cause_text=inc.cause_text, evidence=dict(inc.evidence or {}),
            severity=severity, families=tuple(inc.families), started_at=inc.started_at,
            ends_at=inc.resolved_at, members=infos)
        lead = infos[0]
        title = (f"incident {inc.id}: {len(members)} alert{'s' if len(members) != 1 else ''}"
                 f" ({', '.join(inc.families)}) {status}"
                 + (f" (escalated to {severity})" if kind == "escalated" else "")
                 + (f" (de-escalated to {severity}: no {inc.notified_severity} firing)"
                    if kind == "deescalated" else ""))
        return Notification(key=key, title=title, text=inc.summary, at=self.now,
                            alert=replace(lead, status=status), incident=info)


def awaits_evidence(cause: str, evidence: Mapping[str, Any] | None) -> bool:
    """Return whether a cause is unknown for lack of evidence: no reference arm paired
    during the incident yet, or too few pairs in every bucket for a 95% confidence interval
    (`alerts.cause.measure` states the pairs it compared under "paired", each bucket's
    "during" interval null under alerts.cause.CI_PAIRS pairs). A cause measured with an
    interval but inconclusive (one reaching "alike") does not wait: more pairs of the same
    spread would not settle it within the wait.
    """
    if cause != "unknown":
        return False
    paired = (evidence or {}).get("paired") or {}
    return not any(side.get("during", {}).get("ci95")
                   for buckets in paired.values() for side in buckets.values())


def _rank(severity: str | None) -> int:
    return SEVERITY_ORDER.index(severity) if severity in SEVERITY_ORDER else len(SEVERITY_ORDER)


def _now_severity(members: Sequence[Alert]) -> str | None:
    """Return the most severe severity among the firing members (None: none firing)."""
    firing = [m.severity for m in members if m.state == "firing"]
    return min(firing, key=_rank) if firing else None


def _escalated(inc: Incident, members: Sequence[Alert]) -> bool:
    """Return whether a firing member is more severe than the last firing notification said."""
    told, now = inc.notified_severity, _now_severity(members)
    if told not in SEVERITY_ORDER or now not in SEVERITY_ORDER:
        return False  # never notified (firing goes out), or rows from before the column
    return _rank(now) < _rank(told)


def _deescalated(inc: Incident, members: Sequence[Alert]) -> bool:
    """Return whether receivers were told of a page and no page member fires any more
    (while some member still fires: the incident's end is its resolved notification).

    Only a page ends this way: it is what a pager holds open; a warning easing to info
    changes nothing anyone acts on.
    """
    now = _now_severity(members)
    return inc.notified_severity == "page" and now is not None and _rank(now) > _rank("page")


def _count(inc: Incident) -> None:
    """Settle the cause the counter by cause counts the incident under, once.

    The first cause stated other than unknown, or the one it resolved with: an unknown
    cause is measured again while the incident is open, and a count moved from one cause
    to another would make the other go down.
    """
    if inc.counted_cause is None and (inc.cause != "unknown" or inc.state == "resolved"):
        inc.counted_cause = inc.cause


def _where(alert: Alert) -> str:
    return "(" + (", ".join(f"{k}={v}" for k, v in sorted((alert.labels or {}).items()))
                  or "all") + ")"


def group(session: Session, now: datetime, life: Lifecycle,
          config: IncidentConfig | None = None,
          serving: ServingCohorts | None = None) -> IncidentReport:
    """Group the alerts `life` fired and resolved into incidents; notify them once each.

    serving: the evaluation's read of the cohorts the instances serve (the rollout check
    read it too); None: read here when an alert needs it.
    """
    return Incidents(session, now, config or IncidentConfig(), life, serving).run()


def member_ids(members: Iterable[Alert]) -> list[int]:
    """Return the ids of `members` (for links to their flag changes)."""
    return [m.id for m in members]
