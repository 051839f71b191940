"""Live incident: what the real service pages for an hour of nothing, then for a CPU hog.

The service runs as an operator starts it (`bench.service`): `tailwatch serve` and its
worker, built-in model, shipped rules and policy, a fresh SQLite database, probe and
evaluation intervals 10 s (the rest shipped), real traffic open loop (Poisson, in-domain,
buckets drawn uniformly) at `--rate` per second, and one webhook target per format a
user points at a pager or chat (`generic`, `alertmanager`, `slack`, `alertmanager_api`),
each to its own loopback receiver. Run it pinned (`taskset -c 1 ...`): the service and
its worker inherit the CPU set, and so does the hog.

When the rules arm: the service says so through `GET /v1/baselines`. A rule judging
against a baseline is silent ("baseline warming in") until a stored rolling baseline of
its metric and scope (source, match labels, window) rests on `min_baseline_cycles`
cycles; a fresh cohort's baselines only start `alerts.baseline_warm_in_s` after its
first probe cycle (with the shipped 30 minutes and 30 one-minute cycles for the
latency rules: about an hour after the first probe). The bench polls the active baselines every 10 s; once one is usable
for a shipped rule, the armed time is the earliest `created_at` of any usable baseline
row (inactive ones included), i.e. the evaluation that first could fire, so a page in
the very evaluation that armed the rules counts. Rules with only an absolute ceiling or
floor (`rejections`) judge from the first cycle; their notifications before arming are
shown apart ("before arming").

Phases:
    quiet  `--quiet-minutes` (60) from the armed time: nothing injected.
    hog    `--hog-minutes` (6): a child process busy-looping on the service's CPU set
           (`bench.hog`; `--mild`: busy 30 ms in every 100 ms).
    after  nothing, until no incident has been open for the reopen hold
           (`alerts.incidents.hold_s`, 10 min: a member firing again within it reopens its
           incident), at most `--after-minutes` (40).

Notifications are classified per target from the payload the receiver got, in arrival
order (`classify`): the first firing-status payload of a group (an incident, or an
alert's group for plain alerts) is a firing notification, one while the group is open a
repeat (an update or a re-send), a resolved-status one closes the group; a firing one is
a page when the payload's severity is `page` (slack messages carry no severity: the
members' shipped rules give it). Hog counts are the notifications received from the
hog's start to the run's end whose group fired in that window; ones about groups that
fired before (carried over) are listed apart.

FOLDER holds: `phases.json` (times of every phase, the arming, settings, the incidents
open when the hog started), `notifications-<target>.jsonl` (every POST, as received),
`minutes.csv` (per minute: phase, real requests 200/429/other, client p50/p99, RSS and
CPU seconds of both processes, probe cycles and evaluations), `incidents.json`
(GET /v1/incidents and each GET /v1/incidents/{id}), `alerts.json`
(GET /v1/alerts?state=all), `serve.log`.
The last line, also from `--summarize FOLDER` (a finished run, or one in progress):

    quiet: P pages, W warnings in M min after arming; hog: F firing, R resolved per
    target (generic F/R, alertmanager F/R, ...), cause: <cause>

    taskset -c 1 python -m bench.live_incident [--quiet-minutes 60] [--hog-minutes 6]
        [--after-minutes 40] [--mild] [--rate 3] [--folder var/live-incident]
    python -m bench.live_incident --summarize var/live-incident
    taskset -c 0 python -m bench.live_incident --quick     # a check of every phase, 25 min

`--quick` (phases 3/6/5 minutes, `--warm-in-s 60`, `--min-baseline-cycles 5`: the shipped
rules with baselines usable after 5 cycles, so the rules arm minutes after the start)
checks every phase; its figures are no result.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from alerts.detection import NO_BASELINE
from alerts.rule_file import DEFAULT_RULES_FILE, load_rules
from alerts.rules import PAGE, Rule
from alerts.settings import AlertSettings
from alerts.webhooks import FORMATS, payload_status
from bench.hog import Hog
from bench.service import (
    PoissonTraffic,
    ServiceProcess,
    metric_sum,
    parse_metrics,
    read_posts,
    rules_armed,
    settings_for,
    stop_on_sigterm,
    unix_time,
)
from bench.service_soak import answer_counts
from monitor.loopback import WebhookReceiver

TARGETS = FORMATS  # one target per format, named after it
SEVERITY_ORDER = ("page", "warning", "info")
CYCLE_S = 10.0  # probe and evaluation interval
TICK_S = 5.0
ARM_POLL_S = 10.0
ARM_TIMEOUT_MARGIN_S = 3600.0  # after the warm-in: baselines still need their cycles
STATED_POLL_S = 60.0
SETTLE_POLL_S = 10.0
STATED_TIMEOUT_S = 3600.0
# A series whose cycles (one-minute rollups) number under this share of the minutes since
# the first probe gets data only now and then (a decoding path canaries take in some
# cycles): it states hours after the dense ones, so the hog does not wait for it.
SPARSE_SHARE = 0.5
# A hog shorter than the latency rules' `for` cycles plus their confirmation pages nothing.
QUICK = {"quiet": 3.0, "hog": 6.0, "after": 5.0, "warm_in_s": 60.0, "min_baseline_cycles": 5}
MILD = (30.0, 100.0)  # busy ms in every period ms
FULL = (100.0, 100.0)


# --- what the receivers got --------------------------------------------------------------

@dataclass(frozen=True)
class Received:
    """One notification a receiver got, classified.

    kind: firing (a group opened or reopened), escalated (a page for a group first sent
    as a warning: counted as its page), deescalated (a group sent as a page goes on with
    no page firing: the page is over), repeat (a firing-status payload of a group already
    open: an update or a re-send), resolved, or message. severity: the most severe of the
    payload's firing members (what a receiver routing on severity holds open).
    """

    at: float
    target: str
    kind: str
    group: str
    severity: str | None
    members: tuple[str, ...] = ()  # "rule (labels) change: reason" as the payload says
    cause: str | None = None


def _most_severe(severities: Iterable[str | None]) -> str | None:
    known = [s for s in severities if s in SEVERITY_ORDER]
    return min(known, key=SEVERITY_ORDER.index) if known else None


def _labels_text(labels: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "all"


def _generic_member(a: Mapping[str, Any]) -> str:
    change = a.get("relative_change")
    threshold = a.get("threshold")
    ch = f" {change:+.1%}" if isinstance(change, int | float) else ""
    th = f" (threshold {threshold:+.0%})" if isinstance(threshold, int | float) else ""
    reason = (a.get("annotations") or {}).get("description", "")
    return (f"{a.get('rule')} [{a.get('severity')}, {a.get('status')}] "
            f"({_labels_text(a.get('labels') or {})}){ch}{th}" + (f": {reason}" if reason else ""))


def _am_member(a: Mapping[str, Any]) -> str:
    labels = dict(a.get("labels") or {})
    rule = labels.pop("alertname", "?")
    severity = labels.pop("severity", "?")
    for k in ("service", "job", "instance", "incident"):
        labels.pop(k, None)
    return f"{rule} [{severity}, {_am_status(a)}] ({_labels_text(labels)})"


def _am_status(a: Mapping[str, Any]) -> str:
    # Pushed alerts (alertmanager_api) carry no status: a resolved one carries its endsAt.
    return str(a.get("status") or ("resolved" if "endsAt" in a else "firing"))


SLACK_MEMBER = re.compile(r"^• `([^`]+)` \(([^)]*)\)(?: ([+-][0-9.]+%))? (\w+)$")
SLACK_INCIDENT = re.compile(r"\bincident (\d+):")


def _slack_lines(payload: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for block in payload.get("blocks") or []:
        text = (block.get("text") or {}).get("text", "") if isinstance(block, dict) else ""
        if text.startswith("*Members:*"):
            out += text.splitlines()[1:]
    return out


def _slack_section(payload: Mapping[str, Any]) -> str:
    for block in payload.get("blocks") or []:
        if isinstance(block, dict) and block.get("type") == "section" and "text" in block:
            return str(block["text"].get("text", ""))
    return ""


def _slack_member(line: str, rule_severity: Mapping[str, str]) -> str:
    m = SLACK_MEMBER.match(line)
    if m is None:
        return line
    rule, where, change, status = m.groups()
    return (f"{rule} [{rule_severity.get(rule, '?')}, {status}] ({where})"
            + (f" {change}" if change else ""))


def _slack_severity(payload: Mapping[str, Any], rule_severity: Mapping[str, str]) -> str | None:
    stated = _slack_fact(payload, "*Severity:*")
    if stated is not None:  # an alert's facts, or an incident's severity in force
        return stated
    # Messages from before incidents stated it: the members' shipped rules give it.
    members = [m for line in _slack_lines(payload) if (m := SLACK_MEMBER.match(line))]
    rules = [m.group(1) for m in members if m.group(4) == "firing"] or [
        m.group(1) for m in members]
    return _most_severe(rule_severity.get(r) for r in rules) if rules else None


def _slack_fact(payload: Mapping[str, Any], name: str) -> str | None:
    """Return the value of a message's `*Name:* value` field, if it has one."""
    for block in payload.get("blocks") or []:
        for f in block.get("fields") or [] if isinstance(block, dict) else []:
            text = str(f.get("text", ""))
            if text.startswith(name):
                return text[len(name):].strip()
    return None


def _generic(payload: Mapping[str, Any]) -> tuple[str, str | None, tuple[str, ...], str | None]:
    inc = payload.get("incident")
    if payload.get("kind") == "incident" and isinstance(inc, dict):
        members = tuple(_generic_member(m) for m in inc.get("members") or [])
        return (f"incident {inc.get('id')}", inc.get("severity"), members,
                inc.get("probable_cause") or inc.get("cause"))
    alert = payload.get("alert") or {}
    return (f"alert {alert.get('fingerprint')}", alert.get("severity"),
            (_generic_member(alert),) if alert else (), None)


def _alertmanager(alerts: Sequence[Mapping[str, Any]], group: str | None
                  ) -> tuple[str, str | None, tuple[str, ...], str | None]:
    first = alerts[0] if alerts else {}
    labels = first.get("labels") or {}
    if group is None:
        group = (f"incident {labels['incident']}" if "incident" in labels
                 else json.dumps(labels, sort_keys=True))
    firing = [a for a in alerts if _am_status(a) == "firing"] or alerts
    severity = _most_severe((a.get("labels") or {}).get("severity") for a in firing)
    cause = (first.get("annotations") or {}).get("probable_cause")
    return group, severity, tuple(_am_member(a) for a in alerts), cause


def describe(fmt: str, payload: Any, rule_severity: Mapping[str, str]
             ) -> tuple[str, str | None, tuple[str, ...], str | None]:
    """Return (group, severity, members, probable cause) of one payload of format `fmt`."""
    if fmt == "alertmanager_api":
        return _alertmanager(payload if isinstance(payload, list) else [], None)
    if fmt == "alertmanager":
        alerts = payload.get("alerts") or []
        labels = payload.get("groupLabels") or {}
        group = (f"incident {labels['incident']}" if "incident" in labels
                 else str(payload.get("groupKey")))
        return _alertmanager(alerts, group)
    if fmt == "slack":
        head = str(payload.get("text", ""))
        m = SLACK_INCIDENT.search(head)
        group = f"incident {m.group(1)}" if m else re.sub(r"^\S+ \[\w+\] ", "", head)
        # The summary line (the message's first section) ends with the probable cause.
        _, _, cause = _slack_section(payload).rpartition("probable cause: ")
        members = tuple(_slack_member(line, rule_severity) for line in _slack_lines(payload))
        return group, _slack_severity(payload, rule_severity), members, cause or None
    return _generic(payload)


def is_message(fmt: str, payload: Any) -> bool:
    """Return whether a payload is a plain message (a weekly report), not an alert's."""
    if fmt == "generic":
        return isinstance(payload, dict) and payload.get("kind") == "message"
    if fmt == "alertmanager":
        return (payload.get("groupLabels") or {}).get("alertname") == "TailwatchMessage"
    if fmt == "slack":
        text = str(payload.get("text", ""))
        return "[FIRING]" not in text and "[RESOLVED]" not in text
    return False


def classify(target: str, fmt: str, posts: Iterable[tuple[float, Any]],
             rule_severity: Mapping[str, str]) -> list[Received]:
    """Classify the payloads one target received, in arrival order (see the module doc)."""
    out: list[Received] = []
    open_groups: dict[str, str | None] = {}  # group -> the highest severity it was sent
    for at, payload in sorted(posts, key=lambda p: p[0]):
        if not isinstance(payload, dict | list) or (fmt == "alertmanager_api") != isinstance(
                payload, list):
            continue  # not a notification of this format (never sent by the service)
        if is_message(fmt, payload):
            out.append(Received(at, target, "message", "", None))
            continue
        group, severity, members, cause = describe(fmt, payload, rule_severity)
        if payload_status(fmt, payload) == "resolved":
            kind = "resolved"
            open_groups.pop(group, None)
        elif group in open_groups:
            # A page for a group first sent as a warning is the page (alerts.incidents
            # sends every target an escalation); a page's group going on with no page
            # firing is the page's end (alerts.incidents sends every target a de-escalation).
            was = open_groups[group]
            kind = ("escalated" if severity == "page" and was != "page"
                    else "deescalated" if was == "page" and severity in SEVERITY_ORDER
                    and severity != "page" else "repeat")
            if kind != "repeat":
                open_groups[group] = severity
        else:
            kind = "firing"
            open_groups[group] = severity
        out.append(Received(at, target, kind, group, severity, members, cause))
    return out


# --- when the rules arm ------------------------------------------------------------------

# --- the run's record --------------------------------------------------------------------

@dataclass
class Phases:
    """When each phase ran (unix times; None: not reached) and how the run was set up."""

    started: float
    rate: float
    mild: bool
    quiet_minutes: float
    hog_minutes: float
    after_minutes: float
    warm_in_s: float | None = None  # None: the shipped alerts.baseline_warm_in_s
    min_baseline_cycles: int | None = None  # None: the shipped rules as they are
    # alerts.sensitivity_min_history_s (None: shipped); hog_when_stated: the hog waits, past
    # the quiet minutes, until no series holds its pages (each states its false pages).
    sensitivity_min_history_s: float | None = None
    sensitivity_min_history_cycles: int | None = None
    hog_when_stated: bool = False
    stated: float | None = None  # when the last series stated them
    cpus: list[int] = field(default_factory=list)
    targets: dict[str, str] = field(default_factory=dict)  # name -> format
    ready: float | None = None
    first_probe: float | None = None
    armed: float | None = None
    armed_rules: dict[str, float] = field(default_factory=dict)
    quiet: tuple[float, float] | None = None
    hog: tuple[float, float] | None = None
    after: tuple[float, float] | None = None
    ended: float | None = None
    open_at_hog: list[dict[str, Any]] = field(default_factory=list)  # incidents still open
    hog_pid: int | None = None
    hog_cpus: list[int] = field(default_factory=list)
    hog_exit: int | None = None
    # When no incident had been open for the reopen hold after the hog (None: not settled
    # before --after-minutes ran out).
    settled: float | None = None
    # Since when no incident had been open at the run's end (None: one was open then).
    clear_since: float | None = None
    note: str = ""

    def save(self, folder: Path) -> None:
        """Write phases.json (rewritten at every phase change)."""
        (folder / "phases.json").write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, folder: Path) -> Phases:
        """Read phases.json."""
        raw = json.loads((folder / "phases.json").read_text())
        for k in ("quiet", "hog", "after"):
            if raw.get(k) is not None:
                raw[k] = tuple(raw[k])
        return cls(**raw)


@dataclass(frozen=True)
class Minute:
    """One minute of the run (counts are the minute's)."""

    minute: int  # minutes since the service was ready, at the row's end
    at: str  # UTC, ISO 8601
    phase: str
    ok: int
    rejected_429: int
    errors: int
    p50_ms: float | None  # client-side, of the 200s
    p99_ms: float | None
    serve_rss_mb: float
    worker_rss_mb: float | None
    serve_cpu_s: float | None  # CPU seconds (user + system) the process used in the minute
    worker_cpu_s: float | None
    probe_cycles: int  # -1: the serving process's /metrics could not be read
    evaluations: int  # -1: the worker's /metrics could not be read
    notifications: int  # POSTs to every receiver


COLUMNS = [f.name for f in fields(Minute)]


class Recorder:
    """Write a row a minute, poll the baselines until the rules arm, note the probes."""

    def __init__(self, folder: Path, svc: ServiceProcess, traffic: PoissonTraffic,
                 receivers: Mapping[str, WebhookReceiver], phases: Phases,
                 rules: Sequence[Rule]) -> None:
        self.folder, self.svc, self.traffic = folder, svc, traffic
        self.receivers, self.phases, self.rules = receivers, phases, rules
        self.phase = "warm-in"
        self.csv = folder / "minutes.csv"
        assert phases.ready is not None
        self.next_row = phases.ready + 60.0
        self.minute = 0
        self.next_poll = 0.0
        self.posts = 0
        self.before = self._counts()
        self.cpu_before = svc.cpu_seconds()
        self.clear_since: float | None = None  # until_settled: no incident open since

    def _counts(self) -> tuple[float, float]:
        try:
            m = self.svc.metrics()
        except httpx.HTTPError as e:
            # A service too busy to answer its scrape is what the run records, not an end.
            print(f"{_hms(time.time())} /metrics of serve not read: {e!r}", flush=True)
            return math.nan, math.nan
        probes = metric_sum(m, "tailwatch_job_duration_seconds_count", scheduled_job="probe")
        try:
            w = parse_metrics(httpx.get(f"http://127.0.0.1:{self.svc.worker_port}/metrics",
                                        timeout=10.0).text)
            evals = metric_sum(w, "tailwatch_job_duration_seconds_count",
                               scheduled_job="evaluate")
        except httpx.HTTPError:
            evals = math.nan
        if self.phases.first_probe is None and probes > 0:  # nan > 0 is False
            self.phases.first_probe = time.time()
        return probes, evals

    def wait(self, until: float) -> None:
        """Sleep until `until`, writing rows and polling for the arming on the way."""
        while (now := time.time()) < until:
            time.sleep(max(0.0, min(until, self.next_row, now + TICK_S) - now))
            if time.time() >= self.next_row:
                self._row()
            if self.phases.armed is None and time.time() >= self.next_poll:
                self.next_poll = time.time() + ARM_POLL_S
                self._poll_arming()

    def until_armed(self, timeout_s: float) -> float:
        """Wait until the rules arm; return the armed time (raise TimeoutError past timeout)."""
        deadline = time.time() + timeout_s
        while self.phases.armed is None:
            if time.time() > deadline:
                raise TimeoutError(f"no rule armed within {timeout_s:.0f} s (GET /v1/baselines)")
            self.wait(min(deadline, time.time() + ARM_POLL_S))
        return self.phases.armed

    def until_settled(self, until: float, hold_s: float) -> float | None:
        """Wait until no incident has been open for `hold_s` (a member firing again within
        it would reopen its incident, so ending sooner could miss that notification);
        return when, or None at `until`."""
        clear_since: float | None = None
        while (now := time.time()) < until:
            try:
                open_now = self.svc.get("/v1/incidents", state="open")
            except httpx.HTTPError as e:
                print(f"GET /v1/incidents failed: {e}", flush=True)
                open_now = None
            if open_now:
                clear_since = None
            elif open_now is not None and clear_since is None:
                clear_since = now
                print(f"{_hms(now)} no incident open; the run ends once none has been open "
                      f"for {hold_s / 60:g} min", flush=True)
            self.clear_since = clear_since
            if clear_since is not None and now - clear_since >= hold_s:
                return now
            self.wait(min(until, now + SETTLE_POLL_S))
        return None

    def until_stated(self, timeout_s: float) -> float | None:
        """Wait until every series that could page states its false pages (no page held for
        a young series, `_holds_a_page`); return when, or None past `timeout_s`."""
        deadline = time.time() + timeout_s
        while time.time() <= deadline:
            try:
                rows: list[dict[str, Any]] = self.svc.get("/v1/rules/sensitivity")
            except httpx.HTTPError as e:
                print(f"GET /v1/rules/sensitivity failed: {e}", flush=True)
                rows = []
            held = [r for r in rows if self._holds_a_page(r)]
            if rows and not held:
                print(f"{_hms(time.time())} every series states its false pages "
                      f"({len(rows)} estimated)", flush=True)
                return time.time()
            print(f"{_hms(time.time())} {len(held)} of {len(rows)} series hold their pages "
                  "(insufficient history)", flush=True)
            self.wait(min(deadline, time.time() + STATED_POLL_S))
        return None

    def _holds_a_page(self, row: Mapping[str, Any]) -> bool:
        """Return whether a sensitivity row holds a page the hog could send: its rule pages
        (severity page), its series has a baseline to judge against (a series without
        one, e.g. a decoding path no canary took, holds for ever and pages on nothing) and
        it is not sparse (SPARSE_SHARE)."""
        pages = {r.name for r in self.rules if r.severity == PAGE}
        if not (row.get("pages_held") and row.get("rule") in pages
                and NO_BASELINE not in str(row.get("reason", ""))):
            return False
        first, cycles = self.phases.first_probe, row.get("cycles")
        if first is None or cycles is None:
            return True
        return cycles >= SPARSE_SHARE * (time.time() - first) / 60

    def _poll_arming(self) -> None:
        armed = rules_armed(self.svc, self.rules)
        if not armed:
            return
        self.phases.armed_rules = armed
        self.phases.armed = min(armed.values())
        self.phases.save(self.folder)
        print(f"rules armed at {_hms(self.phases.armed)} UTC (first: "
              f"{min(armed, key=lambda k: armed[k])}; {len(armed)} rules armed by now)",
              flush=True)

    def _row(self) -> None:
        self.minute += 1
        self.next_row += 60.0
        probes, evals = self._counts()
        answers = answer_counts(self.traffic.drain())
        posts = sum(len(rx.deliveries()) for rx in self.receivers.values())
        serve, worker = self.svc.rss()
        cpu = self.svc.cpu_seconds()
        used = [None if now is None or then is None else round(now - then, 2)
                for now, then in zip(cpu, self.cpu_before, strict=True)]
        self.cpu_before = cpu
        row = Minute(
            minute=self.minute, at=datetime.now(UTC).isoformat(timespec="seconds"),
            phase=self.phase, ok=answers.ok, rejected_429=answers.rejected_429,
            errors=answers.errors, p50_ms=answers.p50_ms, p99_ms=answers.p99_ms,
            serve_rss_mb=round(serve / 1e6, 1),
            worker_rss_mb=None if worker is None else round(worker / 1e6, 1),
            serve_cpu_s=used[0], worker_cpu_s=used[1],
            probe_cycles=-1 if math.isnan(probes) or math.isnan(self.before[0])
            else int(probes - self.before[0]),
            evaluations=-1 if math.isnan(evals) or math.isnan(self.before[1])
            else int(evals - self.before[1]),
            notifications=posts - self.posts)
        if not math.isnan(probes):
            self.before = (probes, self.before[1])
        if not math.isnan(evals):
            self.before = (self.before[0], evals)
        self.posts = posts
        new = not self.csv.exists()
        with self.csv.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                w.writeheader()
            w.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})
        print(json.dumps(asdict(row)), flush=True)


def _hms(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def save_incidents(folder: Path, svc: ServiceProcess) -> None:
    """Write incidents.json (each incident's detail) and alerts.json from the API."""
    listed = svc.get("/v1/incidents", state="all", limit=1000)
    details = [svc.get(f"/v1/incidents/{i['id']}") for i in listed]
    (folder / "incidents.json").write_text(json.dumps(details, indent=1) + "\n")
    alerts = svc.get("/v1/alerts", state="all", limit=1000)
    (folder / "alerts.json").write_text(json.dumps(alerts, indent=1) + "\n")


# --- the summary -------------------------------------------------------------------------

@dataclass(frozen=True)
class HogCounts:
    """One target's notifications from the hog's start to the run's end."""

    firing: int  # groups that fired in the window (reopenings included)
    pages: int
    repeats: int
    resolved: int  # of those groups
    carried: int  # notifications about groups that fired before the hog
    still_open: int  # groups that fired in the window and were not resolved by its end


def hog_counts(received: Sequence[Received], start: float, end: float) -> HogCounts:
    """Count one target's notifications received within [start, end].

    What the window started: a group that fired in it, or a group that fired before and
    was escalated to a page in it (the hog's page came as that escalation). Its end: the
    group's resolved notification, or its de-escalation (the page is over; the warnings
    it holds go on, and their later end is not the page's). Notifications about groups
    the window did not start, or after their end, are carried over.
    """
    started: set[str] = set()
    ended: set[str] = set()
    firing = pages = repeats = resolved = carried = 0
    for r in received:
        if r.kind == "message" or not start <= r.at <= end:
            continue
        mine = r.group in started and r.group not in ended
        if r.kind == "firing":
            started.add(r.group)
            ended.discard(r.group)
            firing += 1
            pages += r.severity == "page"
        elif r.kind == "escalated" and r.group not in started:
            started.add(r.group)
            firing += 1
            pages += 1
        elif not mine:
            carried += 1
        elif r.kind == "escalated":
            pages += 1
        elif r.kind in ("resolved", "deescalated"):
            ended.add(r.group)
            resolved += 1
        else:
            repeats += 1
    return HogCounts(firing, pages, repeats, resolved, carried, len(started - ended))


def firing_between(received: Sequence[Received], start: float, end: float) -> list[Received]:
    """Return the firing notifications received within [start, end)."""
    return [r for r in received if r.kind == "firing" and start <= r.at < end]


def _read_minutes(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("minute")]


def _phase_traffic(rows: Sequence[Mapping[str, str]], phase: str) -> str | None:
    mine = [r for r in rows if r["phase"] == phase]
    if not mine:
        return None
    p50 = sorted(float(r["p50_ms"]) for r in mine if r["p50_ms"])
    p99 = [float(r["p99_ms"]) for r in mine if r["p99_ms"]]
    rss = [float(r["serve_rss_mb"]) for r in mine]
    worker = [float(r["worker_rss_mb"]) for r in mine if r["worker_rss_mb"]]
    cycles = sum(max(0, int(r["probe_cycles"])) for r in mine)
    return (f"{phase}: {len(mine)} min, {sum(int(r['ok']) for r in mine)} ok / "
            f"{sum(int(r['rejected_429']) for r in mine)} 429 / "
            f"{sum(int(r['errors']) for r in mine)} other; client p50 "
            + (f"{p50[len(p50) // 2]:.0f} ms (median of minutes), p99 up to {max(p99):.0f} ms"
               if p50 and p99 else "n/a")
            + f"; {cycles / len(mine):.1f} probe cycles/min; RSS serve {rss[-1]:.0f} MB"
            + (f", worker {worker[-1]:.0f} MB" if worker else "")
            + _cpu_share(mine))


def _cpu_share(rows: Sequence[Mapping[str, str]]) -> str:
    """Return "; CPU serve S%, worker W%": each process's mean share of one core."""
    out = []
    for name in ("serve", "worker"):
        used = [float(r[f"{name}_cpu_s"]) for r in rows if r.get(f"{name}_cpu_s")]
        if used:
            out.append(f"{name} {100 * sum(used) / (60 * len(used)):.0f}%")
    return "; CPU " + ", ".join(out) if out else ""


def _incident_causes(incidents: Sequence[Mapping[str, Any]], start: float, end: float
                     ) -> list[Mapping[str, Any]]:
    """Return the incidents a member opened, joined or reopened within [start, end]."""
    out = []
    for inc in incidents:
        events = inc.get("timeline") or []
        if any(e.get("kind") in ("opened", "joined", "reopened")
               and start <= unix_time(str(e["at"])) <= end for e in events):
            out.append(inc)
    return out


@dataclass
class Summary:
    """What a run's folder adds up to; `lines()` ends with the last line."""

    phases: Phases
    received: dict[str, list[Received]]
    incidents: list[Mapping[str, Any]]
    minutes: list[dict[str, str]]

    @property
    def seen_until(self) -> float:
        """Return the latest time the folder knows of (the run's end, else its last row)."""
        if self.phases.ended is not None:
            return self.phases.ended
        if self.minutes:
            return unix_time(self.minutes[-1]["at"])
        return self.phases.ready or self.phases.started

    def quiet_window(self) -> tuple[float, float] | None:
        """Return the quiet phase as covered: arming to its planned end or the last record."""
        if self.phases.armed is None:
            return None
        planned = self.phases.armed + self.phases.quiet_minutes * 60
        end = min(planned, self.phases.hog[0] if self.phases.hog else self.seen_until)
        return self.phases.armed, max(self.phases.armed, end)

    def hog_window(self) -> tuple[float, float] | None:
        """Return the hog's start to the run's end (or the last record)."""
        if self.phases.hog is None:
            return None
        end = self.phases.after[1] if self.phases.after else self.phases.hog[1]
        return self.phases.hog[0], min(end, self.seen_until)

    def cause(self) -> str:
        """Return the probable cause of the incidents the hog opened or joined (the API's)."""
        win = self.hog_window()
        if win is None:
            return "n/a"
        incs = _incident_causes(self.incidents, *win)
        if incs:
            return ", ".join(f"{i.get('cause')} (#{i.get('id')})" for i in incs)
        stated = {r.cause for r in firing_between(self.received.get("generic", []), *win)}
        return ", ".join(sorted(c for c in stated if c)) or "none"

    def _evidence(self, label: str, items: Sequence[Received], since: float) -> list[str]:
        out = []
        for r in items:
            out.append(f"  {label} +{(r.at - since) / 60:.1f} min {r.group} [{r.severity}]"
                       + (f", cause: {r.cause}" if r.cause else ""))
            out += [f"    {m}" for m in r.members]
        return out

    def lines(self) -> list[str]:
        """Return the printed summary; the last line is the targets'."""
        p = self.phases
        generic = self.received.get("generic", [])
        out = [f"conditions: {p.rate:g} real requests/s, CPUs {p.cpus or '?'}, probe and "
               f"evaluation every {CYCLE_S:g} s, warm-in "
               + ("shipped" if p.warm_in_s is None else f"{p.warm_in_s:g} s (not shipped)")
               + ("" if p.min_baseline_cycles is None else
                  f", rules' min_baseline_cycles {p.min_baseline_cycles} (not shipped)")
               + ("" if p.sensitivity_min_history_s is None else
                  f", sensitivity_min_history_s {p.sensitivity_min_history_s:g} (not shipped)")
               + ("" if p.sensitivity_min_history_cycles is None else
                  f", sensitivity_min_history_cycles {p.sensitivity_min_history_cycles} "
                  "(not shipped)")
               + ("" if p.stated is None else
                  f", every series stated its false pages at {_hms(p.stated)} UTC")
               + _settled(p)
               + f", targets {', '.join(p.targets) or '?'}"
               + (f"; {p.note}" if p.note else "")]
        out += [t for ph in ("warm-in", "quiet", "hog", "after")
                if (t := _phase_traffic(self.minutes, ph)) is not None]
        quiet = self.quiet_window()
        if p.armed is not None:
            first = min(p.armed_rules, key=lambda k: p.armed_rules[k]) if p.armed_rules else "?"
            after = f"; {(p.armed - p.ready) / 60:.1f} min after ready" if p.ready else ""
            out.append(f"armed at {_hms(p.armed)} UTC ({first} first{after})")
        since = p.ready or p.started
        before = firing_between(generic, since, p.armed or math.inf)
        if before:
            out.append(f"before arming: {len(before)} firing at generic")
            out += self._evidence("before", before, since)
        if quiet is not None:
            fired = {t: firing_between(rs, *quiet) for t, rs in self.received.items()}
            out.append("quiet, per target (pages/warnings): " + ", ".join(
                f"{t} {sum(r.severity == 'page' for r in f)}/{sum(r.severity != 'page' for r in f)}"
                for t, f in fired.items()))
            out += self._evidence("quiet", firing_between(generic, *quiet), quiet[0])
        hog = self.hog_window()
        counts: dict[str, HogCounts] = {}
        if hog is not None:
            counts = {t: hog_counts(rs, *hog) for t, rs in self.received.items()}
            out.append(("mild neighbour (30 ms busy in 100 ms)" if p.mild else "hog")
                       + f" {_hms(hog[0])}-{_hms(p.hog[1]) if p.hog else '?'} UTC, counted to "
                       f"{_hms(hog[1])}; per target: " + "; ".join(
                           f"{t} {c.firing} firing ({c.pages} pages), {c.repeats} repeats, "
                           f"{c.resolved} resolved, {c.carried} carried over, "
                           f"{c.still_open} still open" for t, c in counts.items()))
            if p.open_at_hog:
                out.append("open when the hog started: " + ", ".join(
                    f"#{i.get('id')} ({i.get('summary')})" for i in p.open_at_hog))
            out += self._evidence("hog", firing_between(generic, *hog), hog[0])
            for inc in _incident_causes(self.incidents, *hog):
                out.append(f"  incident #{inc.get('id')} {inc.get('state')}: {inc.get('summary')}")
        out.append(self.last_line(quiet, counts))
        return out

    def last_line(self, quiet: tuple[float, float] | None,
                  counts: Mapping[str, HogCounts]) -> str:
        """Return `quiet: P pages, W warnings in M min after arming; hog: ..., cause: C`."""
        if quiet is None:
            head = "quiet: not armed"
        else:
            generic = self.received.get("generic", [])
            fired = firing_between(generic, *quiet)
            paged = sum(r.severity == "page" for r in fired)
            pages = paged + sum(r.kind == "escalated" and quiet[0] <= r.at < quiet[1]
                                for r in generic)
            head = (f"quiet: {pages} pages, {len(fired) - paged} warnings in "
                    f"{(quiet[1] - quiet[0]) / 60:.0f} min after arming")
        if not counts:
            return head + "; hog: not run"
        firing = sorted({c.firing for c in counts.values()})
        resolved = sorted({c.resolved for c in counts.values()})

        def span(v: list[int]) -> str:
            return str(v[0]) if len(v) == 1 else f"{v[0]}-{v[-1]}"

        return (f"{head}; hog: {span(firing)} firing, {span(resolved)} resolved per target ("
                + ", ".join(f"{t} {c.firing}/{c.resolved}" for t, c in counts.items())
                + f"), cause: {self.cause()}")


def summarize(folder: Path) -> Summary:
    """Return the summary of a run's folder (finished or in progress)."""
    if not (folder / "phases.json").is_file():
        raise SystemExit(f"--summarize: {folder} holds no phases.json")
    phases = Phases.load(folder)
    severity = {r.name: r.severity for r in load_rules()}
    received = {t: classify(t, fmt, read_posts(folder / f"notifications-{t}.jsonl"), severity)
                for t, fmt in (phases.targets or {t: t for t in TARGETS}).items()}
    inc_file = folder / "incidents.json"
    incidents = json.loads(inc_file.read_text()) if inc_file.is_file() else []
    return Summary(phases, received, incidents, _read_minutes(folder / "minutes.csv"))


# --- the run -----------------------------------------------------------------------------

def thin_rules(folder: Path, cycles: int) -> Path:
    """Write the shipped rules with `min_baseline_cycles` set to `cycles`; return the file.

    A user rule replaces a shipped one by name, so this file replaces them all.
    """
    data = yaml.safe_load(DEFAULT_RULES_FILE.read_text())
    for rule in data["rules"]:
        rule["min_baseline_cycles"] = cycles
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _finish(folder: Path, svc: ServiceProcess, phases: Phases) -> None:
    phases.ended = time.time()
    try:
        save_incidents(folder, svc)
    except (httpx.HTTPError, OSError) as e:
        print(f"incidents not saved: {e}", flush=True)
    phases.save(folder)


def run(folder: Path, phases: Phases) -> None:
    """Run the phases against the real service, recording into `folder`."""
    with ExitStack() as stack:
        receivers = {t: stack.enter_context(WebhookReceiver(
            log_file=folder / f"notifications-{t}.jsonl")) for t in TARGETS}
        alerts: dict[str, Any] = {"webhooks": [{"name": t, "url": rx.url, "format": t}
                                               for t, rx in receivers.items()]}
        if phases.warm_in_s is not None:
            alerts["baseline_warm_in_s"] = phases.warm_in_s
        if phases.sensitivity_min_history_s is not None:
            alerts["sensitivity_min_history_s"] = phases.sensitivity_min_history_s
        if phases.sensitivity_min_history_cycles is not None:
            alerts["sensitivity_min_history_cycles"] = phases.sensitivity_min_history_cycles
        rules_file = None
        if phases.min_baseline_cycles is not None:
            rules_file = str(thin_rules(folder, phases.min_baseline_cycles))
            alerts["rules_file"] = rules_file
        rules = load_rules(rules_file)  # the rules the service judges with: when they arm
        settings = settings_for(folder, receivers["generic"].url, probe_interval_s=CYCLE_S,
                                evaluate_interval_s=CYCLE_S, extra={"alerts": alerts})
        phases.targets = {t: t for t in TARGETS}
        print(f"starting tailwatch serve (log {folder / 'serve.log'})", flush=True)
        svc = stack.enter_context(ServiceProcess(folder, settings))
        phases.ready = time.time()
        phases.cpus = sorted(os.sched_getaffinity(svc.pid))
        phases.save(folder)
        print(f"ready at {_hms(phases.ready)} UTC; serve pid {svc.pid} on CPUs {phases.cpus}; "
              f"{phases.rate:g} requests/s", flush=True)
        traffic = PoissonTraffic(svc.url, rate_per_s=phases.rate, token=svc.token)
        traffic.start()
        stack.callback(traffic.stop)
        stack.callback(_finish, folder, svc, phases)  # runs first: the service still answers
        rec = Recorder(folder, svc, traffic, receivers, phases, rules)
        warm_in = phases.warm_in_s if phases.warm_in_s is not None else \
            AlertSettings().baseline_warm_in_s
        armed = rec.until_armed(warm_in + ARM_TIMEOUT_MARGIN_S)
        phases.quiet = (armed, armed + phases.quiet_minutes * 60)
        phases.save(folder)
        rec.phase = "quiet"
        rec.wait(phases.quiet[1])
        if phases.hog_when_stated:
            phases.stated = rec.until_stated(STATED_TIMEOUT_S)
            if phases.stated is None:
                phases.note += "; the hog started with pages still held (not all stated)"
            phases.quiet = (armed, time.time())  # nothing injected while it waited
            phases.save(folder)
        try:
            phases.open_at_hog = [dict(i) for i in svc.get("/v1/incidents", state="open")]
        except httpx.HTTPError as e:
            phases.note += f"; open incidents not read at the hog's start: {e!r}"
        busy, period = MILD if phases.mild else FULL
        print(f"hog on CPUs {phases.cpus} ({busy:g} ms busy in {period:g} ms) for "
              f"{phases.hog_minutes:g} min", flush=True)
        with Hog(phases.cpus, busy_ms=busy, period_ms=period) as hog:
            start = time.time()
            phases.hog = (start, start + phases.hog_minutes * 60)
            phases.hog_pid, phases.hog_cpus = hog.pid, sorted(os.sched_getaffinity(hog.pid))
            phases.save(folder)
            rec.phase = "hog"
            rec.wait(phases.hog[1])
        phases.hog_exit = hog.returncode
        start = time.time()
        phases.after = (start, start + phases.after_minutes * 60)
        phases.save(folder)
        rec.phase = "after"
        phases.settled = rec.until_settled(phases.after[1], AlertSettings().incidents.hold_s)
        phases.clear_since = rec.clear_since
        phases.after = (start, phases.settled or phases.after[1])
        phases.save(folder)


def _settled(p: Phases) -> str:
    """Return how the after phase ended: settled (no incident open for the hold) or not."""
    if p.after is None or p.hog is None:
        return ""
    if p.settled is not None:
        return (f", settled {(p.settled - p.hog[1]) / 60:.1f} min after the hog (no incident "
                "open for the reopen hold)")
    if p.clear_since is not None:
        return (f", not settled within --after-minutes {p.after_minutes:g} (no incident open "
                f"since {_hms(p.clear_since)}, {(p.after[1] - p.clear_since) / 60:.1f} min "
                "before the end: less than the reopen hold)")
    return f", not settled within --after-minutes {p.after_minutes:g} (an incident open)"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the bench (or summarize a run's folder) and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quiet-minutes", type=float, default=60.0)
    ap.add_argument("--hog-minutes", type=float, default=6.0)
    ap.add_argument("--after-minutes", type=float, default=40.0,
                    help="at most: the run ends once no incident has been open for the "
                    "reopen hold (alerts.incidents.hold_s, 10 min)")
    ap.add_argument("--mild", action="store_true",
                    help="the milder neighbour: busy 30 ms in every 100 ms")
    ap.add_argument("--rate", type=float, default=3.0, help="real requests per second")
    ap.add_argument("--warm-in-s", type=float, default=None,
                    help="alerts.baseline_warm_in_s (default: the shipped one)")
    ap.add_argument("--min-baseline-cycles", type=int, default=None,
                    help="the shipped rules with this min_baseline_cycles (arm sooner; a "
                    "check of the hog's path, not a result)")
    ap.add_argument("--sensitivity-min-history-s", type=float, default=None,
                    help="alerts.sensitivity_min_history_s (with --sensitivity-min-history-"
                    "cycles: series state their false pages, so may page, within a run)")
    ap.add_argument("--sensitivity-min-history-cycles", type=int, default=None,
                    help="alerts.sensitivity_min_history_cycles (the rules' cycles are "
                    "one-minute rollups whatever the probe interval: 360 is 6 h; an "
                    "estimate also needs 3 x (lookback + 10) cycles, 120 for the "
                    "latency rules, whatever this is)")
    ap.add_argument("--hog-when-stated", action="store_true",
                    help="start the hog only once no series holds its pages for want of "
                    "history, sparse series aside (waits past --quiet-minutes, up to an "
                    "hour)")
    ap.add_argument("--quick", action="store_true",
                    help="phases 3/6/5 min, a 60 s warm-in and 5 baseline cycles: arms in "
                    "minutes (a check of every phase, not a result)")
    ap.add_argument("--folder", type=Path, default=Path("var/live-incident"))
    ap.add_argument("--summarize", type=Path, default=None, metavar="FOLDER",
                    help="print the summary of a run's folder (one in progress too) and exit")
    args = ap.parse_args(argv)
    if args.summarize is None:
        if args.quick:
            args.quiet_minutes, args.hog_minutes, args.after_minutes = (
                QUICK["quiet"], QUICK["hog"], QUICK["after"])
            if args.warm_in_s is None:
                args.warm_in_s = QUICK["warm_in_s"]
            if args.min_baseline_cycles is None:
                args.min_baseline_cycles = int(QUICK["min_baseline_cycles"])
        values = (args.quiet_minutes, args.hog_minutes, args.after_minutes, args.rate)
        if not all(math.isfinite(v) and v > 0 for v in values):
            raise SystemExit("--quiet-minutes, --hog-minutes, --after-minutes and --rate "
                             "must be > 0")
        if args.warm_in_s is not None and not (math.isfinite(args.warm_in_s)
                                               and args.warm_in_s >= 0):
            raise SystemExit(f"--warm-in-s: must be >= 0, got {args.warm_in_s}")
        if args.sensitivity_min_history_s is not None and not (
                math.isfinite(args.sensitivity_min_history_s)
                and args.sensitivity_min_history_s >= 0):
            raise SystemExit(f"--sensitivity-min-history-s: must be >= 0, got "
                             f"{args.sensitivity_min_history_s}")
        if args.sensitivity_min_history_cycles is not None and \
                args.sensitivity_min_history_cycles < 10:
            raise SystemExit(f"--sensitivity-min-history-cycles: must be >= 10, got "
                             f"{args.sensitivity_min_history_cycles}")
        if args.min_baseline_cycles is not None and args.min_baseline_cycles < 1:
            raise SystemExit(f"--min-baseline-cycles: must be >= 1, got "
                             f"{args.min_baseline_cycles}")
        if (args.folder / "phases.json").exists():
            raise SystemExit(f"--folder: {args.folder} holds a run already; choose another")
        args.folder.mkdir(parents=True, exist_ok=True)
        phases = Phases(started=time.time(), rate=args.rate, mild=args.mild,
                        quiet_minutes=args.quiet_minutes, hog_minutes=args.hog_minutes,
                        after_minutes=args.after_minutes, warm_in_s=args.warm_in_s,
                        min_baseline_cycles=args.min_baseline_cycles,
                        sensitivity_min_history_s=args.sensitivity_min_history_s,
                        sensitivity_min_history_cycles=args.sensitivity_min_history_cycles,
                        hog_when_stated=args.hog_when_stated,
                        note="quick" if args.quick else "")
        phases.save(args.folder)
        signal.signal(signal.SIGTERM, stop_on_sigterm)
        try:
            run(args.folder, phases)
        finally:  # a run cut short still says what it saw
            for line in summarize(args.folder).lines():
                print(line, flush=True)
        return
    for line in summarize(args.summarize).lines():
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
