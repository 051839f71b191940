"""Every reader on what one run of the real service wrote: report sections and /v1 reads.

A live tailwatch (real uvicorn on loopback, fake engine through the app's seams, A/B
share 1) serves traffic, takes a flag change and runs canary cycles; its scheduled jobs
run as the scheduler would call them. Then the weekly report is built on that database
and every GET /v1 endpoint the API documents is read: none may show nothing for data the
run produced. Where the `prometheus` binary is installed, a real Prometheus scrapes the
service while it runs, and every dashboard panel's PromQL must return data unless all
the metrics it reads are ones this run does not produce (NOT_PRODUCED).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from monitor import scheduler as names
from monitor.hub import services_of
from monitor.jobs import scheduled_jobs
from monitor.report import run_weekly_report
from monitor.report.week import last_seven_days
from tests.monitor.conftest import TOKEN, make_settings, start, wait_for
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer
from tests.monitor.prometheus import (
    dashboard_exprs,
    has_finite_data,
    installed,
    query,
    running_prometheus,
)
from vocab import utcnow

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TEXTS = ("hello river", "the old stone house by the green field",
         "a small light over the water and the long road home")
# What this run writes, so their readers must show it (alerts, deliveries, baselines,
# rollouts and stored reports need faults, receivers, history or a second cohort).
PRODUCED = ("/v1/probes/runs", "/v1/probes/speedups", "/v1/flags", "/v1/flags/audit",
            "/v1/instances")
CYCLES = 3
# Series this run cannot have: no alert fires, no webhook is configured, one cohort
# serves, nothing is rejected and no burst runs; the jobs are called directly (no
# scheduler records job metrics) and no baseline is warm enough for a sensitivity estimate.
NOT_PRODUCED = re.compile(r"tailwatch_(alerts?|deliver|webhook|rollout|rejected|admission"
                          r"|burst|report|job_|rule_)\w*")


def test_every_reader_shows_what_one_run_wrote(migrated_url: str, tmp_path: Path) -> None:
    settings = make_settings(migrated_url, probes={"ab_share": 1.0})
    factory = FakeFactory()
    with LiveServer(start(settings, factory)) as server, \
            _prometheus(server.port, tmp_path) as prom:
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200, timeout_s=60)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.put("/v1/flags/speculative", headers=AUTH,
                         json={"scope": "64", "value": False, "reason": "reader test"})
            assert r.status_code == 200, r.text
            _run(http)
            rounds = 1
            if prom is not None:
                # A counter's first scrape is its start: increase() needs a second round.
                wait_for(lambda: bool(query(prom, "count(tailwatch_canary_duration_seconds_count)")
                                      ["result"]), timeout_s=60)
                _run(http)
                rounds = 2
                _check_panels(prom)
            services = services_of(server.app)
            jobs = scheduled_jobs(services)
            jobs[names.TRAFFIC_FLUSH]()
            jobs[names.EVALUATE]()
            assert services.writer.flush(timeout=30)
            now = utcnow()
            outcome = run_weekly_report(services.sessions, settings, now,
                                        week=last_seven_days(now), out_dir=tmp_path,
                                        notify=False)
            _check_report(outcome.report, outcome.markdown_path.read_text(), rounds)
            _check_reads(http, rounds)
            _check_speedups(outcome.report, http)


@pytest.mark.parametrize("db_kind", ["sqlite"])
def test_every_read_answers_while_another_connection_holds_the_write_lock(
        migrated_url: str) -> None:
    # SQLite's write lock is one per database; a read-only snapshot (storage.db.reading)
    # needs none, so a worker holding it through a long write (or starved at its nice
    # level while it does) must not turn operators' reads into 503s. PostgreSQL readers
    # never wait for writers.
    with LiveServer(start(make_settings(migrated_url), FakeFactory())) as server:
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200, timeout_s=60)
        holder = sqlite3.connect(migrated_url.removeprefix("sqlite:///"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                spec = http.get("/openapi.json").json()
                reads = sorted(p for p, ops in spec["paths"].items()
                               if p.startswith("/v1/") and "get" in ops and "{" not in p)
                codes = {path: http.get(path, headers=AUTH).status_code for path in reads}
        finally:
            holder.rollback()
            holder.close()
    assert len(reads) >= 10
    assert codes == dict.fromkeys(reads, 200)


def _run(http: httpx.Client) -> None:
    """Serve 30 requests and run CYCLES canary cycles."""
    for i in range(30):
        assert http.post("/v1/generate", json={"text": TEXTS[i % 3]}).status_code == 200
    for _ in range(CYCLES):
        # No "ab" in the body: the probes.ab_share of 1 draws every cycle as A/B.
        r = http.post("/v1/probes/run", headers=AUTH, json={"kind": "cycle"})
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["stored"], r.text


def _check_report(report, md: str, rounds: int) -> None:  # type: ignore[no-untyped-def]
    assert report.has_data
    data = report.data
    assert data.p99 and data.p99_week and data.memory and data.traffic and data.acceptance
    assert report.shapes is not None and report.shapes.requests == 30 * rounds
    assert [f.flag for f in report.flag_changes] == ["speculative[64]"]
    measured = {o.name: o for o in report.optimizations if o.speedups}
    # The fake engine's arms: eager (compile) and direct, or speculation switched back on
    # in bucket 64 where its flag is off.
    assert set(measured) == {"torch.compile", "speculative decoding"}
    for o in measured.values():
        assert o.measured_speedup is not None and o.overall is not None
        assert o.overall.pairs == rounds * CYCLES * 6  # six canaries, every cycle A/B
        for c in o.checks:
            if c.assumption.metric == "speedup_vs_expected":
                assert c.status != "no data" and c.verdict.value is not None, c
    spec = {s.bucket: s.arm for s in measured["speculative decoding"].speedups}
    assert spec == {"16": "direct", "32": "direct", "64": "speculative"}
    assert report.measured
    # Only the arms this run does not measure (probes.ab_arms: eager, direct; the fake
    # engine here has no C step, so no compiled_step arm) say so.
    unmeasured = [line for line in md.splitlines() if "nothing measured" in line]
    assert unmeasured and all(any(f"'{arm}'" in line for arm in ("exact", "float32",
                                                                  "compiled_step"))
                              for line in unmeasured)
    costly = md.split("## Optimizations that cost more than they earn")[1].split("##")[0]
    assert "nothing measured" not in costly


def _check_reads(http: httpx.Client, rounds: int) -> None:
    spec = http.get("/openapi.json").json()
    reads = sorted(p for p, ops in spec["paths"].items()
                   if p.startswith("/v1/") and "get" in ops and "{" not in p)
    assert set(PRODUCED) <= set(reads)
    empty = []
    for path in reads:
        r = http.get(path, headers=AUTH)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
        if path in PRODUCED and not r.json():
            empty.append(path)
    assert empty == [], f"reads showing nothing the run wrote: {empty}"
    runs = http.get("/v1/probes/runs", headers=AUTH).json()
    assert [r["kind"] for r in runs] == ["cycle"] * CYCLES * rounds
    speedups = http.get("/v1/probes/speedups", headers=AUTH).json()
    assert {(s["optimization"], s["bucket"]) for s in speedups} >= {
        ("compile", "all"), ("speculative", "all"), ("speculative", "64")}


def _check_speedups(report, http: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    """The report quotes the speedups the API serves; speculation costs where it is slower."""
    served = {(s["optimization"], s["bucket"]): s["speedup"]
              for s in http.get("/v1/probes/speedups", headers=AUTH).json()}
    names = {"torch.compile": "compile", "speculative decoding": "speculative"}
    shown = {(names[o.name], s.bucket): s.measured for o in report.optimizations
             if o.name in names for s in (*o.speedups, o.overall) if s is not None}
    assert shown.keys() == served.keys()
    for key, value in served.items():
        assert shown[key] == pytest.approx(value, rel=0.01), key
    slower = {b for (o, b), v in served.items() if o == "speculative" and v < 1}
    costly = {row.bucket for c in report.costly if c.name == "speculative decoding"
              for row in c.rows}
    assert costly == slower


@contextmanager
def _prometheus(port: int, tmp_path: Path) -> Iterator[str | None]:
    """Run a Prometheus scraping 127.0.0.1:`port` (None: not installed)."""
    if not installed():
        yield None
        return
    with running_prometheus(port, tmp_path) as url:
        yield url


def _check_panels(prom: str) -> None:
    wait_for(lambda: has_finite_data(query(
        prom, "sum(increase(tailwatch_canary_duration_seconds_count[1m])) > 0")), timeout_s=60)
    wait_for(lambda: has_finite_data(query(
        prom, "sum(rate(tailwatch_request_duration_seconds_count[1m])) > 0")), timeout_s=60)
    empty, checked = [], 0
    for expr in dashboard_exprs():
        data = query(prom, re.sub(r"\s+offset\s+\w+", "", expr))  # no history a day ago
        metrics = set(re.findall(r"\btailwatch_\w+", expr))
        if metrics and all(NOT_PRODUCED.fullmatch(m) for m in metrics):
            continue
        checked += 1
        if not has_finite_data(data):
            empty.append(expr)
    assert empty == [], "dashboard panels without data the run produced:\n" + "\n".join(empty)
    assert checked >= 35  # of the dashboards' 43 queries: all but alerts, webhooks, rollouts
