"""Every reader on what one run of the real service wrote: report sections and /v1 reads.

A live tailwatch (real uvicorn on loopback, fake engine through the app's seams, A/B
share 1) serves traffic, takes a flag change and runs canary cycles; its scheduled jobs
run as the scheduler would call them. Then the weekly report is built on that database
and every GET /v1 endpoint the API documents is read: none may show nothing for data the
run produced. Dashboard panels on a real Prometheus: tests/monitor/test_prometheus.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from monitor import scheduler as names
from monitor.report import run_weekly_report
from monitor.report.week import last_seven_days
from monitor.service import scheduled_jobs
from monitor.services import services_of
from tests.monitor.conftest import TOKEN, make_settings, start, wait_for
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer
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


def test_every_reader_shows_what_one_run_wrote(migrated_url: str, tmp_path: Path) -> None:
    settings = make_settings(migrated_url, probes={"ab_share": 1.0})
    factory = FakeFactory()
    with LiveServer(start(settings, factory)) as server:
        wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 200, timeout_s=60)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            _run(http)
            services = services_of(server.app)
            jobs = scheduled_jobs(services)
            jobs[names.TRAFFIC_FLUSH]()
            jobs[names.EVALUATE]()
            assert services.writer.flush(timeout=30)
            now = utcnow()
            outcome = run_weekly_report(services.sessions, settings, now,
                                        week=last_seven_days(now), out_dir=tmp_path,
                                        notify=False)
            _check_report(outcome.report, outcome.markdown_path.read_text())
            _check_reads(http)


def _run(http: httpx.Client) -> None:
    r = http.put("/v1/flags/speculative", headers=AUTH,
                 json={"scope": "64", "value": False, "reason": "reader test"})
    assert r.status_code == 200, r.text
    for i in range(30):
        assert http.post("/v1/generate", json={"text": TEXTS[i % 3]}).status_code == 200
    for _ in range(CYCLES):
        # No "ab" in the body: the probes.ab_share of 1 draws every cycle as A/B.
        r = http.post("/v1/probes/run", headers=AUTH, json={"kind": "cycle"})
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["stored"], r.text


def _check_report(report, md: str) -> None:  # type: ignore[no-untyped-def]
    assert report.has_data
    data = report.data
    assert data.p99 and data.p99_week and data.memory and data.traffic and data.acceptance
    assert report.shapes is not None and report.shapes.requests == 30
    assert [f.flag for f in report.flag_changes] == ["speculative[64]"]
    measured = {o.name: o for o in report.optimizations if o.speedups}
    # The fake engine's arms: eager (compile) and direct, or speculation switched back on
    # in bucket 64 where its flag is off.
    assert set(measured) == {"torch.compile", "speculative decoding"}
    for o in measured.values():
        assert o.measured_speedup is not None and o.overall is not None
        assert o.overall.pairs == CYCLES * 6  # six canaries, every cycle A/B
        for c in o.checks:
            if c.assumption.metric == "speedup_vs_expected":
                assert c.status != "no data" and c.verdict.value is not None, c
    spec = {s.bucket: s.arm for s in measured["speculative decoding"].speedups}
    assert spec == {"16": "direct", "32": "direct", "64": "speculative"}
    assert report.measured
    # Only the arms this run does not measure (probes.ab_arms: eager, direct) say so.
    unmeasured = [line for line in md.splitlines() if "nothing measured" in line]
    assert unmeasured and all("'exact'" in line or "'float32'" in line for line in unmeasured)
    costly = md.split("## Optimizations that cost more than they earn")[1].split("##")[0]
    assert "nothing measured" not in costly


def _check_reads(http: httpx.Client) -> None:
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
    assert [r["kind"] for r in runs] == ["cycle"] * CYCLES
    speedups = http.get("/v1/probes/speedups", headers=AUTH).json()
    assert {(s["optimization"], s["bucket"]) for s in speedups} >= {
        ("compile", "all"), ("speculative", "all"), ("speculative", "64")}
