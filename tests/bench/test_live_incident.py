"""bench.live_incident's bookkeeping: notifications counted per target as received.

The bench needs the real service for two hours; what it computes from what it records
is tested here: payloads the production formatter builds for each target format, POSTed
over loopback to the receivers the bench uses (logged as the bench logs them), incidents
in the API's own schema, baselines as GET /v1/baselines returns them, and a run's folder
summarized as `--summarize` does.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter

from alerts.baselines import rule_scope
from alerts.incidents import IncidentConfig
from alerts.rule_file import load_rules
from alerts.webhooks import (
    FORMATS,
    AlertInfo,
    IncidentInfo,
    Notification,
    WebhookTarget,
    body_bytes,
    format_payload,
)
from bench.live_incident import (
    TARGETS,
    Phases,
    classify,
    hog_counts,
    main,
    summarize,
    thin_rules,
)
from bench.service import armed_rules, read_posts
from monitor.api.baselines import BaselineOut
from monitor.api.incidents import EventOut, IncidentDetail
from monitor.loopback import WebhookReceiver

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
RULES = load_rules()
SEVERITY = {r.name: r.severity for r in RULES}
ARMED = T0.timestamp()
START = ARMED + 1800.0  # the story starts 30 minutes after the rules armed


def _alert(alert_id: int, rule: str, bucket: str, status: str = "firing") -> AlertInfo:
    return AlertInfo(alert_id=alert_id, rule=rule, fingerprint=f"fp{alert_id}",
                     labels={"bucket": bucket, "path": "compiled", "decoding": "speculative"},
                     annotations={"description": f"{rule} median +40.0% over 3 cycles"},
                     severity=SEVERITY[rule], status=status, starts_at=T0, ends_at=None,
                     value=0.2, baseline=0.1, relative_change=0.4, threshold=0.15)


def _incident(inc_id: int, kind: str, members: tuple[AlertInfo, ...], at: datetime
              ) -> Notification:
    status = "resolved" if kind == "resolved" else "firing"
    severity = min((m.severity for m in members), key=("page", "warning", "info").index)
    inc = IncidentInfo(
        incident_id=inc_id, status=status, kind=kind, summary="2 alerts; probable cause: "
        "host or load (optimized and eager/direct arms slowed alike: +90% / +85%)",
        cause="host_or_load", cause_text="host or load (optimized and eager/direct arms "
        "slowed alike: +90% / +85%)", evidence={}, severity=severity, families=("latency",),
        started_at=T0, ends_at=at if status == "resolved" else None, members=members)
    return Notification(key=f"inc{inc_id}-{kind}-{at.isoformat()}", title=f"incident {inc_id}: "
                        f"{len(members)} alerts (latency) {status}", text=inc.summary, at=at,
                        alert=replace(members[0], status=status), incident=inc)


def _story() -> list[tuple[float, str, Notification]]:
    """Return (seconds after T0, kind, notification): two incidents and a weekly message."""
    p99 = _alert(1, "p99_latency_regression", "128")
    p50 = _alert(2, "p50_latency_regression", "128")
    ttft = _alert(3, "ttft_regression", "32")
    at = [T0 + timedelta(seconds=s) for s in range(0, 2000, 100)]
    return [
        (0, "firing", _incident(1, "firing", (p99,), at[0])),
        (100, "update", _incident(1, "update", (p99, p50), at[1])),
        (200, "resend", _incident(1, "resend", (p99, p50), at[2])),
        (300, "resolved", _incident(1, "resolved", (replace(p99, status="resolved"),
                                                    replace(p50, status="resolved")), at[3])),
        (400, "firing", _incident(2, "firing", (ttft,), at[4])),  # a warning
        (500, "message", Notification(key="report", title="weekly report", text="t",
                                      at=at[5])),
        (600, "firing", _incident(1, "firing", (p99,), at[6])),  # reopened
        (700, "resolved", _incident(2, "resolved", (replace(ttft, status="resolved"),),
                                    at[7])),
    ]


def _sends(fmt: str, kind: str) -> bool:
    """Return whether a target of `fmt` gets a notification of `kind` (as the service sends)."""
    if kind == "update":
        return fmt in IncidentConfig().update_formats
    if kind == "resend":
        return fmt == "alertmanager_api"
    if kind == "message":
        return fmt != "alertmanager_api"  # TargetEntry's default: messages off there
    return True


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a folder where each target's receiver logged the story, from START on."""
    folder = tmp_path_factory.mktemp("run")
    with httpx.Client() as client:
        for fmt in FORMATS:
            _record(client, folder, fmt)
    return folder


def _record(client: httpx.Client, folder: Path, fmt: str) -> None:
    """POST the story to a loopback receiver of one target; the receiver logs it."""
    target = WebhookTarget(name=fmt, url="http://127.0.0.1:9/hook", format=fmt)
    with WebhookReceiver(log_file=folder / f"notifications-{fmt}.jsonl") as rx:
        for _, kind, n in _story():
            if _sends(fmt, kind):
                client.post(rx.url, content=body_bytes(format_payload(target, n)),
                            headers={"Content-Type": "application/json"}).raise_for_status()
    # Arrival times as the story has them (the receiver stamps time.time()).
    sent = [s for s, kind, _ in _story() if _sends(fmt, kind)]
    path = folder / f"notifications-{fmt}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**e, "at": START + s}) + "\n"
                            for e, s in zip(lines, sent, strict=True)))


def test_every_format_is_classified_alike(recorded: Path) -> None:
    assert set(TARGETS) == set(FORMATS)
    for fmt in FORMATS:
        got = classify(fmt, fmt, read_posts(recorded / f"notifications-{fmt}.jsonl"), SEVERITY)
        kinds = [(r.at - START, r.kind, r.group, r.severity) for r in got
                 if r.kind != "message"]
        repeats = [(100, "repeat", "incident 1", "page")] if _sends(fmt, "update") else []
        repeats += [(200, "repeat", "incident 1", "page")] if _sends(fmt, "resend") else []
        assert kinds == [(0, "firing", "incident 1", "page"), *repeats,
                         (300, "resolved", "incident 1", "page"),
                         (400, "firing", "incident 2", "warning"),
                         (600, "firing", "incident 1", "page"),
                         (700, "resolved", "incident 2", "warning")], fmt
        assert sum(r.kind == "message" for r in got) == int(_sends(fmt, "message")), fmt
        first = got[0]
        assert any(m.startswith("p99_latency_regression [page") for m in first.members), fmt
        assert first.cause is not None and first.cause.startswith("host or load"), fmt


def test_the_hog_window_counts_its_own_groups_and_lists_the_rest_apart(recorded: Path) -> None:
    got = classify("alertmanager", "alertmanager",
                   read_posts(recorded / "notifications-alertmanager.jsonl"), SEVERITY)
    # From +150 s: incident 1's resolution is carried over (it fired before);
    # incident 2 fires and resolves; incident 1 reopens and is still open at the end.
    c = hog_counts(got, START + 150, START + 800)
    assert (c.firing, c.pages, c.repeats, c.resolved, c.carried, c.still_open) == \
        (2, 1, 0, 1, 1, 1)
    c = hog_counts(got, START, START + 350)
    assert (c.firing, c.pages, c.repeats, c.resolved, c.carried, c.still_open) == \
        (1, 1, 1, 1, 0, 0)


def _baseline(rule_name: str, samples: int, at: datetime, **labels: str) -> dict[str, Any]:
    rule = next(r for r in RULES if r.name == rule_name)
    scope = rule_scope(rule, labels)
    row = BaselineOut(id=1, metric=rule.metric, scope=scope, scope_key="k", kind="rolling",
                      value=0.1, spread=0.01, samples=samples, window_start=at,
                      window_end=at, model_version="m", config_hash="c", created_at=at,
                      pinned_by=None, note=None, active=True)
    out: dict[str, Any] = TypeAdapter(BaselineOut).dump_python(row, mode="json")
    return out


def test_a_rule_arms_when_a_baseline_of_its_scope_rests_on_enough_cycles() -> None:
    p99 = next(r for r in RULES if r.name == "p99_latency_regression")
    need = p99.min_baseline_cycles
    where = {"bucket": "32", "path": "compiled", "decoding": "speculative"}
    thin = _baseline("p99_latency_regression", need - 1, T0, **where)
    assert armed_rules([thin], RULES) == {}
    late = _baseline("p99_latency_regression", need + 5, T0 + timedelta(minutes=3), **where)
    first = _baseline("p99_latency_regression", need, T0 + timedelta(minutes=1), **where)
    season = _baseline("p99_latency_regression", 500, T0, **where, season="hod12")
    traffic = _baseline("traffic_p99_regression", 100, T0 + timedelta(minutes=9),
                        bucket="32")
    got = armed_rules([thin, late, first, season, traffic], RULES)
    assert got["p99_latency_regression"] == (T0 + timedelta(minutes=1)).timestamp()
    assert got["traffic_p99_regression"] == (T0 + timedelta(minutes=9)).timestamp()
    # The canary p99's baselines arm no rule of another source.
    assert "burst_p99_regression" not in got


def _detail(inc_id: int, cause: str, events: list[tuple[datetime, str]]) -> dict[str, Any]:
    d = IncidentDetail(
        id=inc_id, state="resolved", severity="page", started_at=events[0][0],
        resolved_at=events[-1][0], families=["latency"], buckets=["128"], instances=[],
        cohorts=[], summary="1 alert", cause=cause, cause_text=cause, reopened=0, members=1,
        evidence={}, member_alerts=[], flag_changes=[], notifications=[],
        timeline=[EventOut(at=at, kind=kind, alert_id=1, detail="") for at, kind in events])
    out: dict[str, Any] = d.model_dump(mode="json")
    return out


def test_summarize_reads_a_runs_folder(recorded: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    for log in recorded.glob("notifications-*.jsonl"):
        shutil.copy(log, tmp_path)
    armed = ARMED
    # The hog from minute 36 on: incident 2 (a warning) fires and resolves in it,
    # incident 1 reopens at minute 40.
    Phases(started=armed - 3600, rate=3.0, mild=False, quiet_minutes=60.0, hog_minutes=6.0,
           after_minutes=10.0, cpus=[1], targets={t: t for t in TARGETS},
           ready=armed - 1800, armed=armed, armed_rules={"p99_latency_regression": armed},
           quiet=(armed, armed + 3600), hog=(armed + 2150, armed + 2510),
           after=(armed + 2510, armed + 3110), ended=armed + 3111).save(tmp_path)
    at = datetime.fromtimestamp(armed, UTC)
    incidents = [_detail(1, "unknown", [(at + timedelta(seconds=1800), "opened"),
                                        (at + timedelta(seconds=2400), "reopened")]),
                 _detail(2, "host_or_load", [(at + timedelta(seconds=2200), "opened"),
                                             (at + timedelta(seconds=2500), "resolved")])]
    (tmp_path / "incidents.json").write_text(json.dumps(incidents))
    main(["--summarize", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    # The quiet hour is cut short by the hog (36 minutes); in it incident 1 paged once.
    assert out[-1] == (
        "quiet: 1 pages, 0 warnings in 36 min after arming; hog: 2 firing, 1 resolved per "
        "target (generic 2/1, alertmanager 2/1, slack 2/1, alertmanager_api 2/1), cause: "
        "unknown (#1), host_or_load (#2)")
    s = summarize(tmp_path)
    assert s.hog_window() == (armed + 2150, armed + 3110)


def test_summarize_names_a_folder_without_a_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="holds no phases.json"):
        main(["--summarize", str(tmp_path)])


def test_a_run_refuses_bad_phases_and_a_used_folder(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="must be > 0"):
        main(["--hog-minutes", "0", "--folder", str(tmp_path / "a")])
    (tmp_path / "phases.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds a run already"):
        main(["--folder", str(tmp_path)])


def test_thin_rules_replace_every_shipped_rule_with_fewer_baseline_cycles(tmp_path: Path
                                                                          ) -> None:
    thin = load_rules(str(thin_rules(tmp_path, 5)))
    assert {r.name for r in thin} == {r.name for r in RULES}
    assert {r.min_baseline_cycles for r in thin} == {5}
    shipped = {r.name: r for r in RULES}
    assert all(replace(r, min_baseline_cycles=shipped[r.name].min_baseline_cycles)
               == shipped[r.name] for r in thin)


def test_a_page_that_escalates_a_warning_incident_counts_as_its_one_page(
        sessionmaker: Any) -> None:
    """What alerts.incidents sends when a page joins a warning's incident (the outbox's
    own payloads, every format): one firing, one page (the escalation), one resolved."""
    from tests.alerts.test_incident_notifications import P50, P99, at, rows, step, targets

    with sessionmaker.begin() as s:
        tg = targets()
        step(s, at(0), tg, fire=((P50, {"bucket": "64"}),))
        step(s, at(1), tg, fire=((P99, {"bucket": "64"}),))
        step(s, at(20), tg, recover=((P50, {"bucket": "64"}), (P99, {"bucket": "64"})))
        for fmt in FORMATS:
            posts = [(START + i, r.payload) for i, r in enumerate(rows(s, fmt))]
            got = classify(fmt, fmt, posts, SEVERITY)
            assert [r.kind for r in got][:2] == ["firing", "escalated"], fmt
            c = hog_counts(got, START, START + 100)
            assert (c.firing, c.pages, c.resolved) == (1, 1, 1), fmt


def test_a_hog_page_joining_an_open_warning_incident_ends_at_its_deescalation(
        sessionmaker: Any) -> None:
    """The hog's alerts join a warning incident open since before it (a drift holds it):
    its page comes as the escalation and ends as the de-escalation, in every format; the
    incident's own end later is not the hog's."""
    from tests.alerts.test_incident_notifications import P50, P99, at, rows, step, targets

    with sessionmaker.begin() as s:
        tg = targets()
        step(s, at(0), tg, fire=((P50, {"bucket": "64"}),))  # the drift's warning
        step(s, at(30), tg, fire=((P99, {"bucket": "64"}),))  # the hog's page
        step(s, at(40), tg, recover=((P99, {"bucket": "64"}),))  # the hog is over
        step(s, at(90), tg, recover=((P50, {"bucket": "64"}),))  # the drift ends
        for fmt in FORMATS:
            posts = [(START + i, r.payload) for i, r in enumerate(rows(s, fmt))
                     if fmt != "alertmanager_api" or i < 3]  # no re-sends here
            got = classify(fmt, fmt, posts, SEVERITY)
            assert [r.kind for r in got] == ["firing", "escalated", "deescalated",
                                             "resolved"][:len(got)], fmt
            assert [r.severity for r in got[:3]] == ["warning", "page", "warning"], fmt
            c = hog_counts(got, START + 1, START + 2)  # the hog: escalated to de-escalated
            assert (c.firing, c.pages, c.resolved, c.carried, c.still_open) == (
                1, 1, 1, 0, 0), fmt
            c = hog_counts(got, START + 1, START + 100)  # to the run's end
            assert (c.firing, c.resolved, c.carried) == (1, 1, len(got) - 3), fmt


class _Service:
    """What the Recorder reads of a service: sensitivity rows in turn, no metrics."""

    pid = 0
    worker_port = 1  # nothing listens: the evaluations count reads as unknown

    def __init__(self, answers: list[list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.asked = 0

    def metrics(self) -> str:
        raise httpx.ConnectError("not running")

    def cpu_seconds(self) -> tuple[float | None, float | None]:
        return None, None

    def get(self, path: str, **_params: Any) -> list[dict[str, Any]]:
        assert path == "/v1/rules/sensitivity"
        self.asked += 1
        return self.answers[min(self.asked, len(self.answers)) - 1]


def test_the_hog_waits_until_no_series_holds_its_pages(tmp_path: Path, monkeypatch) -> None:
    import bench.live_incident as live

    monkeypatch.setattr(live, "STATED_POLL_S", 0.01)
    monkeypatch.setattr(live, "TICK_S", 0.01)
    rules = load_rules()
    assert {r.name: r.severity for r in rules}["p50_latency_regression"] == "warning"
    held = {"rule": "p99_latency_regression", "pages_held": True,
            "reason": "insufficient history: 64 of 120 cycles, 1.1 of 1 h"}
    stated = {"rule": "p99_latency_regression", "pages_held": False, "reason": ""}
    # Neither can hold a page: a warning rule's series, and one with nothing to judge by
    # (a decoding path no canary took keeps it for ever).
    warning = {"rule": "p50_latency_regression", "pages_held": True,
               "reason": "insufficient history: 64 of 120 cycles, 1.1 of 1 h"}
    empty = {"rule": "p99_latency_regression", "pages_held": True,
             "reason": "insufficient history: no usable baseline yet"}
    svc = _Service([[], [held, stated, warning], [stated, stated, warning, empty]])
    phases = Phases(started=0.0, rate=3.0, mild=False, quiet_minutes=1.0, hog_minutes=1.0,
                    after_minutes=1.0, ready=9e12, armed=1.0, hog_when_stated=True)
    rec = live.Recorder(tmp_path, svc, None, {}, phases, rules)  # type: ignore[arg-type]
    assert rec.until_stated(30.0) is not None and svc.asked == 3  # none, one held, none held
    never = _Service([[held]])
    rec = live.Recorder(tmp_path, never, None, {}, phases, rules)  # type: ignore[arg-type]
    assert rec.until_stated(0.05) is None and never.asked >= 1
    # Two hours after the first probe: a series with 100 cycles is waited for, one that got
    # 22 (canaries take its decoding path in some cycles only) is not.
    phases.first_probe = time.time() - 2 * 3600
    dense = {**held, "cycles": 100}
    sparse = {**held, "cycles": 22}
    waits = _Service([[dense, sparse]])
    rec = live.Recorder(tmp_path, waits, None, {}, phases, rules)  # type: ignore[arg-type]
    assert rec.until_stated(0.05) is None
    goes = _Service([[stated, sparse]])
    rec = live.Recorder(tmp_path, goes, None, {}, phases, rules)  # type: ignore[arg-type]
    assert rec.until_stated(30.0) is not None and goes.asked == 1


def test_a_bad_sensitivity_history_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--sensitivity-min-history-s: must be >= 0"):
        main(["--sensitivity-min-history-s", "-1", "--folder", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="--sensitivity-min-history-cycles: must be >= 10"):
        main(["--sensitivity-min-history-cycles", "5", "--folder", str(tmp_path / "a")])


class _Incidents:
    """What the Recorder reads of a service while it waits to settle: open incidents."""

    pid = 0
    worker_port = 1

    def __init__(self, answers: list[list[dict[str, Any]] | None]) -> None:
        self.answers = answers
        self.asked = 0

    def metrics(self) -> str:
        raise httpx.ConnectError("not running")

    def cpu_seconds(self) -> tuple[float | None, float | None]:
        return None, None

    def get(self, path: str, **params: Any) -> list[dict[str, Any]]:
        assert (path, params) == ("/v1/incidents", {"state": "open"})
        self.asked += 1
        answer = self.answers[min(self.asked, len(self.answers)) - 1]
        if answer is None:
            raise httpx.ConnectError("busy")
        return answer


def test_the_after_phase_ends_once_no_incident_was_open_for_the_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.live_incident as live

    monkeypatch.setattr(live, "SETTLE_POLL_S", 0.01)
    monkeypatch.setattr(live, "TICK_S", 0.01)
    phases = Phases(started=0.0, rate=3.0, mild=False, quiet_minutes=1.0, hog_minutes=1.0,
                    after_minutes=1.0, ready=9e12, armed=1.0)
    incident = {"id": 1, "state": "open"}
    # Open, then closed, open again (a reopen within the hold restarts it), an unanswered
    # read (no evidence either way), then closed for good.
    svc = _Incidents([[incident], [], [incident], None, []])
    rec = live.Recorder(tmp_path, svc, None, {}, phases, [])  # type: ignore[arg-type]
    t0 = time.time()
    settled = rec.until_settled(time.time() + 30.0, hold_s=0.05)
    assert settled is not None and settled - t0 >= 0.05
    assert svc.asked >= 6  # settled only after the last closed run lasted the hold
    always = _Incidents([[incident]])
    rec = live.Recorder(tmp_path, always, None, {}, phases, [])  # type: ignore[arg-type]
    assert rec.until_settled(time.time() + 0.05, hold_s=0.0) is None


def test_the_summary_says_whether_the_after_phase_settled() -> None:
    from bench.live_incident import _settled

    phases = Phases(started=0.0, rate=3.0, mild=False, quiet_minutes=1.0, hog_minutes=6.0,
                    after_minutes=40.0, hog=(0.0, 360.0), after=(360.0, 1500.0),
                    settled=1500.0)
    assert _settled(phases) == (", settled 19.0 min after the hog (no incident open for the "
                                "reopen hold)")
    open_at_end = Phases(started=0.0, rate=3.0, mild=False, quiet_minutes=1.0,
                         hog_minutes=6.0, after_minutes=40.0, hog=(0.0, 360.0),
                         after=(360.0, 2760.0))
    assert _settled(open_at_end) == (", not settled within --after-minutes 40 "
                                     "(an incident open)")
    # Every incident resolved, but too late in the phase for the reopen hold to pass.
    held = replace(open_at_end, clear_since=2400.0)
    assert _settled(held) == (", not settled within --after-minutes 40 (no incident open "
                              "since 00:40:00, 6.0 min before the end: less than the reopen "
                              "hold)")


class _Busy(_Service):
    """A service whose processes used CPU: 1.5 s serving and 0.25 s in the worker a minute."""

    def __init__(self) -> None:
        super().__init__([])
        self.reads = 0

    def cpu_seconds(self) -> tuple[float | None, float | None]:
        self.reads += 1
        return 10.0 + 1.5 * self.reads, 4.0 + 0.25 * self.reads

    def rss(self) -> tuple[int, int | None]:
        return 500_000_000, 200_000_000


class _NoTraffic:
    def drain(self) -> list[Any]:
        return []


def test_each_minute_records_the_cpu_both_processes_used(tmp_path: Path) -> None:
    import bench.live_incident as live

    phases = Phases(started=0.0, rate=3.0, mild=False, quiet_minutes=1.0, hog_minutes=1.0,
                    after_minutes=1.0, ready=9e12, armed=1.0)
    rec = live.Recorder(tmp_path, _Busy(), _NoTraffic(), {}, phases,  # type: ignore[arg-type]
                        load_rules())
    rec._row()
    rec._row()
    rows = live._read_minutes(tmp_path / "minutes.csv")
    assert [(r["serve_cpu_s"], r["worker_cpu_s"]) for r in rows] == [("1.5", "0.25")] * 2
    assert live._cpu_share(rows) == "; CPU serve 2%, worker 0%"
    assert live._cpu_share([{"serve_cpu_s": "30"}]) == "; CPU serve 50%"
