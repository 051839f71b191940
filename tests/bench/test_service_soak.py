"""bench.service_soak's bookkeeping: notifications counted as received, rows to summary.

The soak itself needs the real service for hours; what is computed from what it
records is tested here: payloads the production formatter builds, POSTed over loopback
to the receiver the soak uses, and the CSV the soak appends to, summarized as
`--summarize` does for a run in progress.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from alerts.baselines import rule_scope
from alerts.rule_file import load_rules
from alerts.webhooks import (
    AlertInfo,
    IncidentInfo,
    Notification,
    WebhookTarget,
    body_bytes,
    format_payload,
)
from bench.service import Answer, parse_metrics
from bench.service_soak import (
    BURST_GRACE_S,
    Recorder,
    Row,
    answer_counts,
    burst_windows,
    main,
    notification_counts,
    read_rows,
    summarize,
    write_row,
)
from monitor.loopback import WebhookReceiver

T = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
GENERIC = WebhookTarget(name="bench", url="http://127.0.0.1:9/hook", format="generic")


def _alert(severity: str, status: str) -> AlertInfo:
    return AlertInfo(alert_id=1, rule="p99_latency_regression", fingerprint="f",
                     labels={"bucket": "32"}, annotations={}, severity=severity,
                     status=status, starts_at=T, ends_at=None)


def _incident(severity: str, kind: str) -> Notification:
    member = _alert(severity, "firing" if kind == "firing" else "resolved")
    inc = IncidentInfo(incident_id=7, status=member.status, kind=kind, summary="s",
                       cause="host_or_load", cause_text="t", evidence={}, severity=severity,
                       families=("latency",), started_at=T, ends_at=None, members=(member,))
    return Notification(key=f"incident-7-{kind}", title="t", text="t", at=T, alert=member,
                        incident=inc)


def test_notifications_are_counted_as_the_receiver_got_them() -> None:
    sent = [
        _incident("page", "firing"),
        _incident("page", "update"),  # members changed: neither firing nor resolved
        _incident("page", "resolved"),
        _incident("warning", "firing"),
        Notification(key="a", title="t", text="t", at=T, alert=_alert("page", "firing")),
        Notification(key="m", title="weekly report", text="t", at=T),  # a message
    ]
    with WebhookReceiver() as rx:
        for n in sent:
            httpx.post(rx.url, content=body_bytes(format_payload(GENERIC, n)),
                       headers={"Content-Type": "application/json"}).raise_for_status()
        payloads = [d.body for d in rx.deliveries()]
    assert len(payloads) == len(sent)
    assert notification_counts(payloads) == (3, 1, 2)


def test_a_minute_of_answers_counts_429s_apart_and_those_due_during_a_burst() -> None:
    answers = [Answer(1000.0 + i, 200, 0.010 * i, "16") for i in range(1, 101)]
    answers += [Answer(1005.0, 429, 0.001), Answer(1011.5, 429, 0.001),  # in the window
                Answer(1050.0, 429, 0.001), Answer(1001.0, 0, 120.0), Answer(1002.0, 503, 0.0)]
    got = answer_counts(answers, [(1004.0, 1009.5 + BURST_GRACE_S)])
    assert (got.ok, got.rejected_429, got.errors, got.rejected_in_bursts) == (100, 3, 2, 2)
    assert got.p50_ms == pytest.approx(500.0)
    assert got.p99_ms == pytest.approx(990.0)
    # The errors by status, kept in the row and summed in the summary: what they were.
    assert got.error_statuses == "0:1 503:1"
    rows = [_row(1, errors=2, error_statuses=got.error_statuses),
            _row(2, errors=1, error_statuses="503:1"), _row(3)]
    assert summarize(rows).lines()[0].startswith(
        "minutes: 3; real requests: ")
    assert "3 other errors (1 no answer, 2 503); " in summarize(rows).lines()[0]


def test_burst_windows_come_from_the_services_probe_gauges() -> None:
    text = """# HELP tailwatch_probe_duration_seconds Duration of the latest probe run of a kind.
# TYPE tailwatch_probe_duration_seconds gauge
tailwatch_probe_duration_seconds{kind="burst",suite="in_domain"} 2.5
tailwatch_probe_duration_seconds{kind="cycle",suite="in_domain"} 9.0
# HELP tailwatch_probe_last_run_timestamp_seconds Unix time the latest run finished.
# TYPE tailwatch_probe_last_run_timestamp_seconds gauge
tailwatch_probe_last_run_timestamp_seconds{kind="burst",suite="in_domain"} 1000.0
tailwatch_probe_last_run_timestamp_seconds{kind="cycle",suite="in_domain"} 1200.0
"""
    assert burst_windows(parse_metrics(text)) == {(997.5, 1000.0 + BURST_GRACE_S)}


def _row(minute: int, **kw: object) -> Row:
    base = Row(minute=minute, at=T.isoformat(), armed_min=minute - 31.0,
               serve_rss_mb=500.0 + (minute if minute < 30 else 30 + (minute - 30) / 30),
               worker_rss_mb=150.0, ok=600, rejected_429=0, errors=0, p50_ms=20.0,
               p99_ms=150.0, real_refused=0, synthetic_refused=minute, firing=0, resolved=0,
               pages=0, probe_cycles=6, bursts=0, rejected_in_bursts=0, burst_window_s=0.0)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_the_summary_fits_rss_after_warm_up_and_counts_pages_after_arming(
        tmp_path: Path) -> None:
    path = tmp_path / "soak.csv"
    pages = {20: 1, 45: 1, 100: 1}  # before arming, in its first hour, after it
    rows = [_row(m, pages=pages.get(m, 0), firing=pages.get(m, 0),
                 rejected_429=(7 if m == 50 else 1), rejected_in_bursts=2 if m == 50 else 0,
                 bursts=int(m % 15 == 0), burst_window_s=4.0 if m % 15 == 0 else 0.0,
                 worker_rss_mb=None if m == 60 else 150.0)  # the worker restarting
            for m in range(1, 121)]
    for r in rows:
        write_row(path, r)
    assert read_rows(path) == rows
    armed = T.timestamp() + 30 * 60  # the first row: 30 minutes before arming
    page = format_payload(GENERIC, _incident("page", "firing"))
    warning = format_payload(GENERIC, _incident("warning", "firing"))
    notifications = [(armed - 300, page), (armed + 600, page), (armed + 601, warning),
                     (armed + 3700, page)]
    s = summarize(read_rows(path), notifications)
    assert s.first_hour_rules == {"p99_latency_regression": 1}
    assert s.page_rules == {"p99_latency_regression": 3}
    assert s.serve_mb_per_h == pytest.approx(2.0)  # 1 MB per 30 min after minute 30
    assert s.worker_mb_per_h == pytest.approx(0.0)
    assert s.last_hour_mb_per_h == (pytest.approx(2.0), pytest.approx(0.0))
    assert (s.pages, s.pages_first_hour, s.armed_minutes) == (3, 1, 60)
    assert (s.rejected_429, s.rejected_in_bursts, s.bursts) == (126, 2, 8)
    assert s.synthetic_refused == 120
    # 124 refusals in 7,168 s outside the bursts: 0.6 expected in their 32 s.
    assert s.expected_in_bursts == pytest.approx(124 / (7200 - 32) * 32)
    assert s.lines()[-1] == ("real requests shed by probes: 2 (429 answers to real requests "
                             "due during the 8 bursts' 32 s, 0.6 expected there at the other "
                             "429s' rate; target 0)")
    assert s.lines()[-3].startswith("rss growth after 30 min: serve +2.0 MB/h (530 -> 533 MB)")


def test_rss_floors_are_fitted_beside_the_minute_end_readings(tmp_path: Path) -> None:
    # End-of-minute readings swing by 60 MB with where they fall between two trims; the
    # floors under them rise 3 MB/h, and the summary fits both.
    rows = [_row(m, serve_rss_mb=600.0 + 60.0 * (m % 2),
                 serve_rss_floor_mb=580.0 + m / 20, worker_rss_floor_mb=140.0)
            for m in range(1, 91)]
    path = tmp_path / "soak.csv"
    for r in rows:
        write_row(path, r)
    s = summarize(read_rows(path))
    assert s.floor_mb_per_h == (pytest.approx(3.0), pytest.approx(0.0))
    assert "; floors: serve +3.0 MB/h, worker +0.0 MB/h" in s.lines()[-3]
    # A CSV written before the floors were recorded: no floors, no floor figures.
    old = summarize([_row(m) for m in range(1, 91)])
    assert old.floor_mb_per_h == (None, None) and "floors" not in old.lines()[-3]


class _Quiet:
    """No traffic answers and no webhook deliveries (the recorder's other two sources)."""

    def drain(self) -> list[object]:
        return []

    def deliveries(self) -> list[object]:
        return []


class _Svc:
    """The recorder's view of a service: RSS readings in turn, no metrics."""

    def __init__(self, readings: list[tuple[int, int | None]],
                 worker_text: str = "", serve_text: str = "") -> None:
        self.readings = readings
        self.worker_text = worker_text  # the worker's /metrics exposition
        self.serve_text = serve_text  # the serving process's

    def rss(self) -> tuple[int, int | None]:
        return self.readings.pop(0)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return parse_metrics(self.serve_text)

    def worker_metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return parse_metrics(self.worker_text)


def test_the_recorder_keeps_each_minutes_lowest_rss() -> None:
    svc = _Svc([(700_000_000, 150_000_000), (640_000_000, None), (690_000_000, 149_000_000),
                (710_000_000, 151_000_000)])
    rec = Recorder(svc, _Quiet(), _Quiet(), ready=0.0)  # type: ignore[arg-type]
    for _ in range(3):
        rec.sample_rss()
    row = rec.row(1)
    assert (row.serve_rss_mb, row.worker_rss_mb) == (710.0, 151.0)  # the minute's end
    assert (row.serve_rss_floor_mb, row.worker_rss_floor_mb) == (640.0, 149.0)
    assert rec.floor == (None, None)  # the next minute starts afresh
    assert (row.worker_sqlite_mb, row.worker_malloc_mb) == (None, None)  # not exported


def test_the_worker_heaps_come_from_its_metrics_and_are_fitted(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from monitor.metrics import Metrics, ProcessMemoryCollector

    registry = CollectorRegistry()
    ProcessMemoryCollector(Metrics(registry), heaps=lambda: [
        ("rss", 150_000_000), ("sqlite", 12_345_678), ("malloc_in_use", 40_000_000)])
    svc = _Svc([(700_000_000, 150_000_000)], generate_latest(registry).decode())
    row = Recorder(svc, _Quiet(), _Quiet(), ready=0.0).row(1)  # type: ignore[arg-type]
    assert (row.worker_sqlite_mb, row.worker_malloc_mb) == (12.3, 40.0)
    # The summary fits them after the warm-up: SQLite's caches +6 MB/h here.
    path = tmp_path / "soak.csv"
    for m in range(1, 91):
        write_row(path, _row(m, worker_sqlite_mb=2.0 + m / 10, worker_malloc_mb=40.0))
    lines = summarize(read_rows(path)).lines()
    assert lines[-4] == ("worker's heaps after 30 min: sqlite 5.0 -> 11.0 MB (+6.0 MB/h), "
                         "malloc in use 40.0 -> 40.0 MB (+0.0 MB/h)")


def test_the_serving_processs_heaps_come_from_its_own_metrics(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from monitor.metrics import Metrics, ProcessMemoryCollector

    registry = CollectorRegistry()
    ProcessMemoryCollector(Metrics(registry), heaps=lambda: [
        ("rss", 650_000_000), ("sqlite", 3_000_000), ("malloc_in_use", 90_000_000)])
    svc = _Svc([(650_000_000, 150_000_000)], serve_text=generate_latest(registry).decode())
    row = Recorder(svc, _Quiet(), _Quiet(), ready=0.0).row(1)  # type: ignore[arg-type]
    assert (row.serve_sqlite_mb, row.serve_malloc_mb) == (3.0, 90.0)
    assert (row.worker_sqlite_mb, row.worker_malloc_mb) == (None, None)
    path = tmp_path / "soak.csv"
    for m in range(1, 91):
        write_row(path, _row(m, serve_sqlite_mb=3.0, serve_malloc_mb=90.0 + m / 60))
    lines = summarize(read_rows(path)).lines()
    assert lines[-4] == ("serve's heaps after 30 min: sqlite 3.0 -> 3.0 MB (+0.0 MB/h), "
                         "malloc in use 90.5 -> 91.5 MB (+1.0 MB/h)")


def test_summarize_reads_a_run_in_progress(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "soak.csv"
    for m in range(1, 41):
        write_row(path, _row(m, armed_min=None if m < 3 else m - 33.0,
                             rejected_429=1 if m in (10, 11) else 0))
    main(["--summarize", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == ("pages in the first hour after the rules armed: 0 (only 7 of its "
                       "60 minutes so far) (target 0)")
    assert out[-1].startswith("real requests shed by probes: 0 ")


def test_summarize_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--summarize: .* is no file"):
        main(["--summarize", str(tmp_path / "none.csv")])


def test_a_saturated_run_says_so_first() -> None:
    rows = [_row(m, ok=450, rejected_429=150) for m in range(1, 11)]
    lines = summarize(rows).lines()
    assert lines[0].startswith("saturated: 25% of the real requests were answered 429")
    assert len(summarize([_row(1)]).lines()) == 5


def _refused(path: str, **params: object) -> object:
    raise httpx.ConnectError("connection refused")


def test_the_recorder_takes_the_armed_time_from_the_services_baselines() -> None:
    """Armed as the service tells it (its first usable baseline, an inactive one
    included), not the first probe cycle plus the warm-in: the rules arm about an hour
    after ready, and the first hour after arming is what #38's target counts."""
    rules = load_rules()
    p99 = next(r for r in rules if r.name == "p99_latency_regression")
    armed_at = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)

    def row(samples: int, at: datetime) -> dict[str, object]:
        return {"metric": p99.metric, "scope": {**rule_scope(p99, {}), "bucket": "32"},
                "samples": samples, "created_at": at.isoformat()}

    class Svc(_Svc):
        def __init__(self) -> None:
            super().__init__([(600_000_000, 140_000_000)])
            self.active = [row(3, armed_at)]  # warming in
            self.inactive: list[dict[str, object]] = []
            self.asked: list[bool] = []

        def get(self, path: str, **params: object) -> list[dict[str, object]]:
            assert path == "/v1/baselines"
            self.asked.append(bool(params["include_inactive"]))
            return self.active + (self.inactive if params["include_inactive"] else [])

    svc = Svc()
    rec = Recorder(svc, _Quiet(), _Quiet(), ready=0.0, rules=rules)  # type: ignore[arg-type]
    rec.poll_arming()
    assert rec.armed is None and svc.asked == [False]
    svc.get = _refused  # type: ignore[method-assign,assignment]  # fails: asked again later
    rec.poll_arming()
    assert rec.armed is None
    del svc.get
    # Refreshed since: the row that armed the rule is inactive, the active one younger.
    svc.inactive = [row(p99.min_baseline_cycles, armed_at)]
    svc.active = [row(p99.min_baseline_cycles + 5, armed_at + timedelta(minutes=7))]
    rec.poll_arming()
    assert rec.armed == armed_at.timestamp() and svc.asked == [False, False, True]
    minutes = rec.row(1).armed_min
    assert minutes is not None and minutes == pytest.approx(
        (datetime.now(UTC) - armed_at).total_seconds() / 60, abs=0.1)
