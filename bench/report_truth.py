"""Report truth: does every reader show what a real run of the service wrote?

The service runs as an operator starts it (`bench.service`): `tailwatch serve` and its
worker, built-in model, shipped rules and policy, a fresh SQLite database (or
`--database-url`, which must be empty), probe and evaluation intervals `--interval`
(10 s), every canary cycle with its A/B arms (`probes.ab_share: 1`, the shipped
`probes.ab_arms`), real open-loop traffic (Poisson, in-domain, buckets drawn uniformly)
at `--rate` per second, bursts at `--burst-interval-s` (0: none). A real Prometheus
scrapes the serving process and its worker every 5 s.

After `--minutes`:

1. Dashboard panels: every PromQL expression of the shipped dashboards is evaluated over
   the run (a range query, run start to now, as Grafana draws a panel over its time
   range; `offset` dropped: a run has no history a day back). A panel is EMPTY when it
   returns no finite value although every series selector in it (metric and label
   matchers, e.g. `tailwatch_alerts{state="pending"}`) matches series in Prometheus; a
   panel with a selector the run never produced is "not produced" (listed, not counted).
2. The service is stopped, so that the database holds exactly what the run wrote, and
   the real CLI writes the report: `tailwatch --config FILE report --out DIR --no-notify`.
3. The service is started again on the same database with its scheduler off (nothing new
   is written) and every `GET /v1/...` the OpenAPI document lists (no path parameters)
   is read with its defaults, and `/v1/probes/speedups` over the report's own window.
4. Checks on the report's Markdown and the reads:
   - speedups: every optimization x bucket row of "Expected vs measured speedup" against
     the API's (same window): each in both, the same pair count, the value within 1%
     (the report prints 3 significant digits: 0.5% at most of rounding);
   - costly: every optimization x bucket the API measures below 1 is listed under
     "Optimizations that cost more than they earn" (and nothing else is);
   - sections: a section is EMPTY when the run wrote the data it needs (NEEDS, counted
     in the database with plain queries on the tables, not through the readers) and it
     shows the sentence it shows for no data, or when it is blank; a section shown
     without data must say so (its sentence), never be blank; an optimization whose A/B
     arm has pairs must not say "measured: n/a"; a plot of the HTML report missing
     although the run wrote what it draws (PLOT_NEEDS) counts as an empty section;
   - reads: a GET is EMPTY when its data (READ_NEEDS, the endpoint's default filter) is
     in the database and it answers nothing ([], or only empty lists and objects).

FOLDER holds `tailwatch.yaml`, `service.db`, `serve.log`, `reports/report-*.md`,
`reads.json` (every GET's answer), `panels.json`, `truth.json` (every finding) and
`prometheus/` (its data: `--check` evaluates the panels again from it).
The last line:

    report truth: S speedups compared, max diff D%, costly listed C of K, empty sections E,
    empty reads A, empty panels P

    taskset -c 0 python -m bench.report_truth [--minutes 15] [--rate 0.5] [--interval 10]
        [--burst-interval-s 300] [--warm-in-s 120 --min-baseline-cycles 5] [--suite shifted]
        [--folder var/report-truth] [--database-url postgresql+psycopg://...]
    python -m bench.report_truth --check var/report-truth    # a finished run, checked again

`--suite shifted` runs the canaries on the shipped suite of text the draft model predicts
badly, so speculation measures slower than direct in some buckets and the costly list
has something to show. `--warm-in-s` / `--min-baseline-cycles` arm the shipped rules
minutes after the start (baselines, sensitivity estimates, possibly alerts), so more
readers have data to show;
without them the rules stay silent for the shipped warm-in and those readers must say
that they have nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from bench.live_incident import thin_rules
from bench.service import PoissonTraffic, ServiceProcess, settings_for
from monitor.loopback import WebhookReceiver, free_port
from monitor.report.registry import load_registry
from storage import make_engine, make_sessionmaker
from storage.models import (
    Alert,
    Baseline,
    CompileEvent,
    FlagAudit,
    Incident,
    MemorySample,
    OutputAgreement,
    ProbeResult,
    ProbeRun,
    Report,
    RolloutVerdict,
    RuleSensitivity,
    TrafficRollup,
    WebhookDelivery,
)
from storage.queries.speedups import ALL_BUCKETS, OPTIMIZATION_OF_ARM

TOLERANCE = 0.01  # the report's speedup vs the API's, relative
REPORT_TIMEOUT_S = 600.0
# Scrape interval (and timeout): on a shared core the serving process's /metrics can take
# over a second, and a 1 s scrape then times out and records nothing.
SCRAPE_INTERVAL_S = 5
ALL_LABEL = "all (every bucket's pairs)"  # the report's bucket cell for ALL_BUCKETS
COSTLY = "Optimizations that cost more than they earn"
SPEEDUPS = "Expected vs measured speedup"


# --------------------------------------------------------------------------- written data

@dataclass(frozen=True)
class Written:
    """What the run wrote, counted on the tables (what the readers must then show)."""

    ab_pairs: int = 0  # prompt pairs in A/B cycles (probe_runs.details["pairs"])
    probe_runs: int = 0
    traffic_requests: int = 0  # real requests in the traffic rollups
    memory_samples: int = 0
    flag_audits: int = 0
    alerts: int = 0
    fired_alerts: int = 0  # ever fired (the report lists these; pending ones notified nobody)
    open_alerts: int = 0  # pending or firing
    incidents: int = 0
    agreements: int = 0  # output_agreements rows
    rollout_verdicts: int = 0
    sensitivities: int = 0
    active_baselines: int = 0
    dead_deliveries: int = 0
    reports: int = 0
    canary_p99_rows: int = 0  # optimized canary results of cycles with a p99
    drafted: int = 0  # draft tokens proposed, real traffic and canaries
    recompiles: int = 0  # recompiles and recompile-limit hits
    measured_arms: frozenset[str] = frozenset()  # A/B arms with at least one pair


def count_written(session: Session) -> Written:
    """Return what the database holds, by plain counts on the tables."""
    def n(stmt: Any) -> int:
        return int(session.scalar(stmt) or 0)

    pairs, arms = 0, set[str]()
    for details in session.scalars(select(ProbeRun.details).where(ProbeRun.kind == "cycle")):
        for p in (details or {}).get("pairs") or ():
            latency = p.get("latency_s") if isinstance(p, dict) else None
            if isinstance(latency, dict) and "optimized" in latency and len(latency) > 1:
                pairs += 1
                arms.update(a for a in latency if a != "optimized")
    return Written(
        ab_pairs=pairs,
        probe_runs=n(select(func.count()).select_from(ProbeRun)),
        traffic_requests=n(select(func.sum(TrafficRollup.requests))),
        memory_samples=n(select(func.count()).select_from(MemorySample)),
        flag_audits=n(select(func.count()).select_from(FlagAudit)),
        alerts=n(select(func.count()).select_from(Alert)),
        fired_alerts=n(select(func.count()).select_from(Alert)
                       .where(Alert.fired_at.is_not(None))),
        open_alerts=n(select(func.count()).select_from(Alert)
                      .where(Alert.state.in_(("pending", "firing")))),
        incidents=n(select(func.count()).select_from(Incident)),
        agreements=n(select(func.count()).select_from(OutputAgreement)),
        rollout_verdicts=n(select(func.count()).select_from(RolloutVerdict)),
        sensitivities=n(select(func.count()).select_from(RuleSensitivity)),
        active_baselines=n(select(func.count()).select_from(Baseline)
                           .where(Baseline.active.is_(True))),
        dead_deliveries=n(select(func.count()).select_from(WebhookDelivery)
                          .where(WebhookDelivery.state == "dead")),
        reports=n(select(func.count()).select_from(Report)),
        canary_p99_rows=n(select(func.count()).select_from(ProbeResult).join(ProbeRun).where(
            ProbeRun.kind == "cycle", ProbeResult.variant == "optimized",
            ProbeResult.p99_s.is_not(None))),
        drafted=n(select(func.sum(TrafficRollup.draft_tokens)))
        + n(select(func.sum(ProbeResult.draft_tokens))),
        recompiles=n(select(func.sum(CompileEvent.recompiles + CompileEvent.limit_hits))),
        measured_arms=frozenset(arms))


@dataclass(frozen=True)
class Need:
    """What part of a section, or a read, needs: its no-data sentence and the data behind it."""

    empty: str  # the text it shows when it has nothing ("" for a GET: an empty answer)
    wrote: Callable[[Written], bool]
    what: str  # the data, in words


# Per report section: each no-data sentence it may show, and the data that forbids it.
NEEDS: dict[str, tuple[Need, ...]] = {
    "Optimizations": (),  # one heading per optimization always; "measured: n/a" is checked apart
    SPEEDUPS: (Need("nothing measured: no A/B prompt pairs this week",
                    lambda w: w.ab_pairs > 0, "A/B prompt pairs"),),
    COSTLY: (Need("nothing measured: no A/B prompt pairs this week",
                  lambda w: w.ab_pairs > 0, "A/B prompt pairs"),),
    "Alerts": (Need("no incidents this week", lambda w: w.incidents > 0, "incidents"),
               Need("no alerts this week", lambda w: w.fired_alerts > 0, "fired alerts")),
    "Flag changes": (Need("no flag changes this week", lambda w: w.flag_audits > 0,
                          "flag audit rows"),),
    "Real-traffic shapes": (Need("no real traffic this week", lambda w: w.traffic_requests > 0,
                                 "real requests in traffic rollups"),),
    "Quality": (Need("No outputs were compared with reference outputs this week.",
                     lambda w: w.agreements > 0, "output agreement rows"),),
    "Rollouts": (Need("No rollout this week: one cohort served at a time.",
                      lambda w: w.rollout_verdicts > 0, "rollout verdicts"),),
    "What this monitor can see": (
        Need("No estimate yet: the sensitivity job has not run on a warm baseline.",
             lambda w: w.sensitivities > 0, "sensitivity estimates"),),
    "Webhook dead letters": (
        Need("No dead letters: every notification of the week was delivered or is still "
             "being retried.", lambda w: w.dead_deliveries > 0, "dead webhook deliveries"),),
    "Recommendations": (Need("None.", lambda w: w.traffic_requests > 0,
                             "real traffic (the context cap is always recommended)"),),
}

# Per plot of the HTML report (its id, plot-KEY): the data it draws.
PLOT_NEEDS: dict[str, Need] = {
    "p99": Need("", lambda w: w.canary_p99_rows > 0, "optimized canary p99s of cycles"),
    "acceptance": Need("", lambda w: w.drafted > 0, "draft tokens proposed"),
    "memory": Need("", lambda w: w.memory_samples > 0, "memory samples"),
    "recompiles": Need("", lambda w: w.recompiles > 0, "recompiles or recompile-limit hits"),
    "shapes": Need("", lambda w: w.traffic_requests > 0, "real requests in traffic rollups"),
}

# Per GET /v1 read (its defaults): the data that forbids an empty answer.
READ_NEEDS: dict[str, Need] = {
    "/v1/alerts": Need("", lambda w: w.open_alerts > 0, "open (pending or firing) alerts"),
    "/v1/baselines": Need("", lambda w: w.active_baselines > 0, "active baselines"),
    "/v1/deliveries": Need("", lambda w: w.dead_deliveries > 0, "dead webhook deliveries"),
    "/v1/flags": Need("", lambda w: True, "the engine's flags (always)"),
    "/v1/flags/audit": Need("", lambda w: w.flag_audits > 0, "flag audit rows"),
    "/v1/incidents": Need("", lambda w: w.incidents > 0, "incidents"),
    "/v1/instances": Need("", lambda w: w.probe_runs + w.traffic_requests
                          + w.memory_samples > 0, "probe runs, traffic or memory samples"),
    "/v1/probes/runs": Need("", lambda w: w.probe_runs > 0, "probe runs"),
    "/v1/probes/speedups": Need("", lambda w: w.ab_pairs > 0, "A/B prompt pairs"),
    "/v1/reports": Need("", lambda w: w.reports > 0, "stored reports"),
    "/v1/rollouts": Need("", lambda w: w.rollout_verdicts > 0, "rollout verdicts"),
    "/v1/rules/sensitivity": Need("", lambda w: w.sensitivities > 0, "sensitivity estimates"),
}


# --------------------------------------------------------------------------- the report

def sections(markdown: str) -> dict[str, str]:
    """Return each `## ` section's body (text up to the next `## `), by title."""
    out: dict[str, str] = {}
    for chunk in re.split(r"^## ", markdown, flags=re.M)[1:]:
        title, _, body = chunk.partition("\n")
        out[title.strip()] = body.strip()
    return out


def table(body: str) -> list[dict[str, str]]:
    """Return the rows of the first Markdown table in `body`, as header -> cell."""
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    if len(lines) < 2:
        return []
    header, *rows = ([c.replace("\\|", "|").strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
                     for ln in lines)
    return [dict(zip(header, r, strict=False)) for r in rows
            if not all(set(c) <= set("-") for c in r)]


def optimization_keys(user_file: str | None = None) -> dict[str, str]:
    """Return report optimization name -> the API's optimization (via its A/B arm)."""
    return {o.name: OPTIMIZATION_OF_ARM[o.ab_arm]
            for o in load_registry(user_file).optimizations
            if o.ab_arm in OPTIMIZATION_OF_ARM}


def _bucket(cell: str) -> str:
    return ALL_BUCKETS if cell == ALL_LABEL else cell


def report_speedups(markdown: str, names: Mapping[str, str]) -> dict[tuple[str, str],
                                                                     tuple[float, int]]:
    """Return (optimization, bucket) -> (measured speedup, pairs) of the report's table."""
    out = {}
    for row in table(sections(markdown).get(SPEEDUPS, "")):
        key = (names.get(row["Optimization"], row["Optimization"]), _bucket(row["Bucket"]))
        out[key] = (float(row["Measured"]), int(row["Pairs"]))
    return out


def costly_listed(markdown: str, names: Mapping[str, str]) -> set[tuple[str, str]]:
    """Return the (optimization, bucket) rows listed as costing more than they earn."""
    return {(names.get(r["Optimization"], r["Optimization"]), _bucket(r["Bucket"]))
            for r in table(sections(markdown).get(COSTLY, ""))}


def unmeasured_optimizations(markdown: str, names: Mapping[str, str],
                             arms: frozenset[str]) -> list[str]:
    """Return optimizations the run measured (an arm with pairs) shown as `measured: n/a`."""
    measured = {OPTIMIZATION_OF_ARM[a] for a in arms if a in OPTIMIZATION_OF_ARM}
    body = sections(markdown).get("Optimizations", "")
    out = []
    for chunk in re.split(r"^### ", body, flags=re.M)[1:]:
        name = chunk.partition("\n")[0].rsplit(":", 1)[0].strip()
        if names.get(name) in measured and "; measured: n/a." in chunk:
            out.append(f"Optimizations: {name} says 'measured: n/a' although its arm was measured")
    return out


# --------------------------------------------------------------------------- comparisons

@dataclass
class Comparison:
    """The report's speedups against the API's."""

    compared: int = 0
    max_diff: float = 0.0  # relative
    mismatched: list[str] = field(default_factory=list)
    costly_listed: int = 0
    costly_expected: int = 0
    costly_missing: list[str] = field(default_factory=list)
    costly_extra: list[str] = field(default_factory=list)


def compare(report: Mapping[tuple[str, str], tuple[float, int]],
            listed: set[tuple[str, str]], api: Sequence[Mapping[str, Any]]) -> Comparison:
    """Compare the report's speedups and costly rows with the API's speedups."""
    out = Comparison()
    served = {(s["optimization"], s["bucket"]): s for s in api}
    for key in sorted(set(report) | set(served)):
        name = f"{key[0]}[{key[1]}]"
        if key not in served:
            out.mismatched.append(f"{name}: in the report, not in the API")
            continue
        if key not in report:
            out.mismatched.append(f"{name}: in the API ({served[key]['speedup']:.3g}x), "
                                  "not in the report")
            continue
        value, pairs = report[key]
        want = float(served[key]["speedup"])
        diff = abs(value - want) / want
        out.compared += 1
        out.max_diff = max(out.max_diff, diff)
        if diff > TOLERANCE or pairs != served[key]["pairs"]:
            out.mismatched.append(f"{name}: report {value:g}x on {pairs} pairs, API "
                                  f"{want:.4g}x on {served[key]['pairs']}")
    slower = {k for k, s in served.items() if float(s["speedup"]) < 1.0}
    out.costly_expected = len(slower)
    out.costly_listed = len(slower & listed)
    out.costly_missing = [f"{o}[{b}] ({served[(o, b)]['speedup']:.3g}x)"
                          for o, b in sorted(slower - listed)]
    out.costly_extra = [f"{o}[{b}]" for o, b in sorted(listed - slower)]
    return out


def empty_sections(markdown: str, wrote: Written,
                   names: Mapping[str, str] | None = None) -> list[str]:
    """Return each section (or part) showing nothing although the run wrote its data."""
    found = sections(markdown)
    out = []
    for title, needs in NEEDS.items():
        body = found.get(title)
        if body is None:
            out.append(f"{title}: missing from the report")
            continue
        if not body:
            out.append(f"{title}: blank")
            continue
        for need in needs:
            if need.wrote(wrote) and need.empty in body:
                out.append(f"{title}: says {need.empty!r} although the run wrote {need.what}")
    out += unmeasured_optimizations(markdown, names or optimization_keys(), wrote.measured_arms)
    return out


def missing_plots(html: str, wrote: Written) -> list[str]:
    """Return each HTML plot left out although the run wrote the data it draws."""
    shown = set(re.findall(r'id="plot-([\w-]+)"', html))
    return [f"Plots: no {key!r} plot although the run wrote {need.what}"
            for key, need in PLOT_NEEDS.items() if need.wrote(wrote) and key not in shown]


def is_empty(body: Any) -> bool:
    """Return whether a JSON answer shows nothing: [], {}, or only empty lists and objects."""
    if isinstance(body, list | dict) and not body:
        return True
    if isinstance(body, dict):
        nested = [v for v in body.values() if isinstance(v, list | dict)]
        return bool(nested) and not any(nested)
    return False


def empty_reads(answers: Mapping[str, Any], wrote: Written) -> tuple[list[str], list[str]]:
    """Return (reads empty although their data was written, reads with no need defined)."""
    empty, undefined = [], []
    for path, body in sorted(answers.items()):
        need = READ_NEEDS.get(path)
        if need is None:
            undefined.append(path)
        elif need.wrote(wrote) and is_empty(body):
            empty.append(f"{path}: answers nothing although the run wrote {need.what}")
    return empty, undefined


# --------------------------------------------------------------------------- panels

# A series selector of a panel: metric name and label matchers (e.g. state="pending").
SELECTOR = re.compile(r"\btailwatch_\w+(?:\{[^}]*\})?")


@dataclass(frozen=True)
class Panel:
    """One dashboard expression evaluated over the run."""

    expr: str
    metrics: tuple[str, ...]  # its series selectors
    missing: tuple[str, ...]  # selectors matching no series in Prometheus: not produced
    has_data: bool

    @property
    def empty(self) -> bool:
        """Return whether it shows nothing although every metric it reads was produced."""
        return not self.has_data and not self.missing


def panel_exprs() -> list[str]:
    """Return every dashboard PromQL expression (variables as Grafana's "All" expands them)."""
    from tests.monitor.prometheus import dashboard_exprs

    return dashboard_exprs()


def evaluate_panels(prom: str, start: float, end: float) -> list[Panel]:
    """Evaluate every dashboard expression over [start, end] on Prometheus at `prom`."""
    out = []
    with httpx.Client(base_url=prom, timeout=30) as http:
        def rng(expr: str) -> list[Any]:
            r = http.get("/api/v1/query_range", params={
                "query": expr, "start": start, "end": end, "step": "15s"})
            body = r.json()
            if r.status_code != 200 or body.get("status") != "success":
                raise RuntimeError(f"Prometheus refused {expr}: {body}")
            return list(body["data"]["result"])

        for raw in panel_exprs():
            expr = re.sub(r"\s+offset\s+\w+", "", raw)  # a run has no history a day back
            metrics = tuple(sorted(set(SELECTOR.findall(expr))))
            missing = tuple(m for m in metrics if not rng(f"count({m})"))
            finite = any(not math.isnan(float(v)) for s in rng(expr) for _, v in s["values"])
            out.append(Panel(raw, metrics, missing, finite))
    return out


@contextmanager
def prometheus(ports: Sequence[int], workdir: Path) -> Iterator[str]:
    """Run a real Prometheus scraping 127.0.0.1 at `ports`; yield its URL."""
    from tests.monitor.prometheus import running_prometheus

    workdir.mkdir(parents=True, exist_ok=True)
    with running_prometheus(ports[0], workdir, extra_targets=ports[1:],
                            scrape_interval_s=SCRAPE_INTERVAL_S) as url:
        yield url


# --------------------------------------------------------------------------- the run

@dataclass(frozen=True)
class Options:
    """How the run is made."""

    minutes: float = 15.0
    rate: float = 0.5
    interval_s: float = 10.0
    burst_interval_s: float = 300.0  # 0: no bursts
    warm_in_s: float | None = None  # None: shipped alerts.baseline_warm_in_s
    min_baseline_cycles: int | None = None  # None: the shipped rules as they are
    database_url: str | None = None
    suite: str | None = None  # probes.suite; None: shipped (in_domain)


def service_settings(folder: Path, webhook_url: str, opts: Options) -> dict[str, Any]:
    """Return the run's settings: shipped ones but intervals, A/B share 1 and warm-in."""
    alerts: dict[str, Any] = {}
    if opts.warm_in_s is not None:
        alerts["baseline_warm_in_s"] = opts.warm_in_s
    if opts.min_baseline_cycles is not None:
        alerts["rules_file"] = str(thin_rules(folder, opts.min_baseline_cycles))
    scheduler: dict[str, Any] = {}
    if opts.burst_interval_s > 0:
        scheduler["burst_interval_s"] = opts.burst_interval_s
    else:
        scheduler["burst_interval_s"] = 10 * 365 * 86400.0  # none within the run
    return settings_for(folder, webhook_url, database_url=opts.database_url,
                        probe_interval_s=opts.interval_s, evaluate_interval_s=opts.interval_s,
                        extra={"probes": {"ab_share": 1.0,
                                          **({"suite": opts.suite} if opts.suite else {})},
                               "alerts": alerts,
                               "scheduler": scheduler})


def run_report_cli(config: Path, out_dir: Path) -> Path:
    """Run `tailwatch --config FILE report` as an operator does; return the Markdown path."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TAILWATCH_")}
    done = subprocess.run(
        [sys.executable, "-m", "monitor.cli", "--config", str(config), "report",
         "--out", str(out_dir), "--no-notify"],
        env=env, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S, check=False)
    print(done.stdout.strip(), flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"tailwatch report exited {done.returncode}: {done.stderr.strip()}")
    found = sorted(out_dir.glob("report-*.md"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"tailwatch report wrote no Markdown into {out_dir}")
    return found[-1]


def report_window(markdown: str) -> tuple[str, str]:
    """Return the report's window (start, end) as RFC 3339."""
    m = re.search(r"^Window: (\S+) \.\. (\S+)", markdown, flags=re.M)
    if m is None:
        raise ValueError("the report states no window")
    return tuple(f"{t[:-1]}:00Z" for t in m.groups())  # type: ignore[return-value]


def read_all(svc: ServiceProcess, window: tuple[str, str]) -> tuple[dict[str, Any], Any]:
    """Return every GET /v1 read (defaults) and the speedups over the report's window."""
    spec = svc.get("/openapi.json")
    paths = sorted(p for p, ops in spec["paths"].items()
                   if p.startswith("/v1/") and "get" in ops and "{" not in p)
    answers = {p: svc.get(p) for p in paths}
    speedups = svc.get("/v1/probes/speedups", since=window[0], until=window[1])
    return answers, speedups


def run(folder: Path, opts: Options) -> dict[str, Any]:
    """Run the service, then check every reader; return the findings."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("service.db", "service.db-wal", "service.db-shm"):
        (folder / stale).unlink(missing_ok=True)
    with WebhookReceiver(log_file=folder / "notifications.jsonl") as rx:
        settings = service_settings(folder, rx.url, opts)
        with ExitStack() as stack:
            svc = stack.enter_context(ServiceProcess(folder, settings))
            prom = stack.enter_context(prometheus((svc.port, svc.worker_port),
                                                  folder / "prometheus"))
            print(f"ready; {opts.minutes:g} min of traffic at {opts.rate:g}/s", flush=True)
            started = time.time()
            traffic = PoissonTraffic(svc.url, rate_per_s=opts.rate, token=svc.token)
            traffic.start()
            try:
                time.sleep(opts.minutes * 60)
            finally:
                traffic.stop()
            answers = traffic.drain()
            time.sleep(5)  # one more scrape of both processes
            panels = evaluate_panels(prom, started, time.time())
        # The service is stopped: the database holds what the run wrote, and no more.
        md_path = run_report_cli(folder / "tailwatch.yaml", folder / "reports")
        markdown = md_path.read_text()
        html = md_path.with_suffix(".html").read_text()
        frozen = {**settings, "scheduler": {**settings["scheduler"], "enabled": False}}
        with ServiceProcess(folder, frozen) as svc:
            reads, speedups = read_all(svc, report_window(markdown))
    engine = make_engine(settings["database_url"])
    try:
        with make_sessionmaker(engine)() as session:
            wrote = count_written(session)
    finally:
        engine.dispose()
    return findings(folder, markdown, wrote, reads, speedups, panels, html=html,
                    ok=sum(a.status == 200 for a in answers), sent=len(answers))


def findings(folder: Path, markdown: str, wrote: Written, reads: Mapping[str, Any],
             speedups: Sequence[Mapping[str, Any]], panels: Sequence[Panel], *,
             html: str | None = None, ok: int = 0, sent: int = 0) -> dict[str, Any]:
    """Check everything, write reads.json, panels.json and truth.json; return the findings."""
    names = optimization_keys()
    cmp = compare(report_speedups(markdown, names), costly_listed(markdown, names), speedups)
    sections_empty = empty_sections(markdown, wrote, names)
    if html is not None:
        sections_empty += missing_plots(html, wrote)
    reads_empty, undefined = empty_reads(reads, wrote)
    out: dict[str, Any] = {
        "requests": {"sent": sent, "ok": ok},
        "written": {k: (sorted(v) if isinstance(v, frozenset) else v)
                    for k, v in asdict(wrote).items()},
        "comparison": asdict(cmp),
        "empty_sections": sections_empty,
        "empty_reads": reads_empty,
        "reads_without_need": undefined,
        "empty_panels": [p.expr for p in panels if p.empty],
        "panels_not_produced": {p.expr: list(p.missing) for p in panels if p.missing},
        "panels_checked": sum(not p.missing for p in panels),
    }
    (folder / "reads.json").write_text(json.dumps({"reads": reads, "speedups": speedups},
                                                  indent=1, default=str))
    (folder / "panels.json").write_text(json.dumps([asdict(p) for p in panels], indent=1))
    (folder / "truth.json").write_text(json.dumps(out, indent=1))
    out["line"] = last_line(cmp, len(sections_empty), len(reads_empty), len(out["empty_panels"]))
    return out


def check_folder(folder: Path) -> dict[str, Any]:
    """Return the findings of a finished run's folder again (after the checks changed)."""
    import yaml

    settings = yaml.safe_load((folder / "tailwatch.yaml").read_text())
    md_path = sorted((folder / "reports").glob("report-*.md"), key=lambda p: p.stat().st_mtime)[-1]
    saved = json.loads((folder / "reads.json").read_text())
    engine = make_engine(settings["database_url"])
    try:
        with make_sessionmaker(engine)() as session:
            wrote = count_written(session)
            first, last = session.execute(select(func.min(ProbeRun.started_at),
                                                 func.max(ProbeRun.started_at))).one()
    finally:
        engine.dispose()
    if (folder / "prometheus" / "tsdb").is_dir() and first is not None:
        # Prometheus's own data of the run: the panels are evaluated again as now defined.
        from tests.monitor.prometheus import running_prometheus

        with running_prometheus(free_port(), folder / "prometheus") as prom:
            panels = evaluate_panels(prom, first.timestamp() - 60, last.timestamp() + 60)
    else:
        panels = [Panel(p["expr"], tuple(p["metrics"]), tuple(p["missing"]), p["has_data"])
                  for p in json.loads((folder / "panels.json").read_text())]
    return findings(folder, md_path.read_text(), wrote, saved["reads"], saved["speedups"],
                    panels, html=md_path.with_suffix(".html").read_text())


def last_line(cmp: Comparison, sections_empty: int, reads_empty: int, panels_empty: int) -> str:
    """Return the run's one-line result."""
    return (f"report truth: {cmp.compared} speedups compared, max diff "
            f"{cmp.max_diff * 100:.2f}%, costly listed {cmp.costly_listed} of "
            f"{cmp.costly_expected}, empty sections {sections_empty}, empty reads "
            f"{reads_empty}, empty panels {panels_empty}")


def print_findings(out: Mapping[str, Any]) -> None:
    """Print every finding, then the last line."""
    cmp = out["comparison"]
    if out["requests"]["sent"]:
        print(f"real requests: {out['requests']['ok']} of {out['requests']['sent']} "
              "answered 200")
    print("written: " + ", ".join(f"{k} {v}" for k, v in out["written"].items()))
    for title, items in (("speedup mismatches", cmp["mismatched"]),
                         ("slower than the reference, not listed as costly",
                          cmp["costly_missing"]),
                         ("listed as costly, not slower", cmp["costly_extra"]),
                         ("empty sections", out["empty_sections"]),
                         ("empty reads", out["empty_reads"]),
                         ("reads without a defined need (not checked)",
                          out["reads_without_need"]),
                         ("empty panels", out["empty_panels"])):
        for item in items:
            print(f"{title}: {item}")
    print(f"panels checked {out['panels_checked']}; not produced by this run: "
          f"{len(out['panels_not_produced'])} (their metrics: "
          + ", ".join(sorted({m for ms in out["panels_not_produced"].values() for m in ms}))
          + ")")
    print(out["line"], flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments, run and print the findings."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--rate", type=float, default=0.5, help="real requests per second")
    ap.add_argument("--interval", type=float, default=10.0,
                    help="probe and evaluation interval, seconds")
    ap.add_argument("--burst-interval-s", type=float, default=300.0, help="0: no bursts")
    ap.add_argument("--warm-in-s", type=float, default=None,
                    help="alerts.baseline_warm_in_s (default: shipped)")
    ap.add_argument("--min-baseline-cycles", type=int, default=None,
                    help="every shipped rule's min_baseline_cycles (default: as shipped)")
    ap.add_argument("--suite", default=None,
                    help="probes.suite for the canaries (default: shipped in_domain; "
                    "shifted: text the draft model predicts badly)")
    ap.add_argument("--database-url", default=None, help="an EMPTY database (default: SQLite "
                    "in the folder, made fresh)")
    ap.add_argument("--folder", type=Path, default=Path("var/report-truth"))
    ap.add_argument("--check", type=Path, default=None, metavar="FOLDER",
                    help="check a finished run's folder again; run nothing")
    args = ap.parse_args(argv)
    if args.check is not None:
        print_findings(check_folder(args.check))
        return
    if args.minutes <= 0 or args.rate <= 0 or args.interval <= 0:
        ap.error("--minutes, --rate and --interval: must be > 0")
    opts = Options(args.minutes, args.rate, args.interval, args.burst_interval_s,
                   args.warm_in_s, args.min_baseline_cycles, args.database_url, args.suite)
    print(f"started {datetime.now(UTC):%Y-%m-%d %H:%M}Z; folder {args.folder}", flush=True)
    print_findings(run(args.folder, opts))


if __name__ == "__main__":
    main()
