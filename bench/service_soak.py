"""Live soak: the real `tailwatch serve` (and its worker) under 10 requests/s for 2 hours.

The service runs as an operator starts it (`bench.service`): built-in model, shipped
rules and policy, a fresh SQLite database, probe and evaluation intervals at 10 s (the
rest shipped: a burst every 15 minutes), one generic webhook to a loopback receiver.
Real traffic is open loop: Poisson arrivals at `--rate` per second, in-domain inputs,
buckets drawn uniformly. Nothing is injected.

Every minute a row is appended to `FOLDER/soak.csv` (see `Row`): RSS of the serving
process and of its worker (at the minute's end, and the minute's floor: the lowest of
its readings every 5 s; what the worker's RSS holds: its SQLite caches and malloc's
blocks in use, from its /metrics), the minute's real requests by answer (200, 429, other), the
service's own count of real requests refused by admission, webhook notifications
(firing, resolved, pages = firing with severity page), probe cycles and bursts run,
and the minutes since the rules armed, as the service tells it (`bench.service.rules_armed`:
the first usable baseline of a shipped rule, polled from GET /v1/baselines as
`bench.live_incident` does; about an hour after ready). The receiver's payloads go to
`FOLDER/notifications.jsonl`, the service's log to `FOLDER/serve.log`.

At the end, and for any CSV (a run still in progress included) with `--summarize`:

    worker's heaps after 30 min: sqlite A -> B MB (S MB/h), malloc in use ...
    rss growth after 30 min: serve X MB/h, worker Y MB/h (least squares; target < 5 MB/h);
        floors: serve X' MB/h, worker Y' MB/h (the same fit over each minute's lowest RSS)
    pages in the first hour after the rules armed: N (target 0)
    real requests shed by probes: R (429 answers to real requests; target 0)

    taskset -c 1 python -m bench.service_soak [--minutes 120] [--rate 10] [--folder var/soak-run]
    python -m bench.service_soak --summarize var/soak-run/soak.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alerts.rule_file import load_rules
from alerts.rules import Rule
from bench.service import (
    Answer,
    PoissonTraffic,
    Samples,
    ServiceProcess,
    metric_sum,
    percentile,
    read_posts,
    rules_armed,
    settings_for,
    stop_on_sigterm,
)
from monitor.loopback import WebhookReceiver

WARM_MINUTES = 30  # RSS growth is fitted after this
ARMED_HOUR = 60
TICK_S = 5.0
ARM_POLL_S = 10.0  # how often the arming is asked for until the rules arm
SATURATED_SHARE = 0.01  # more real requests than this answered 429: the engine is saturated
BURST_GRACE_S = 2.0  # answers to requests due just after a burst still meet its queue

Window = tuple[float, float]  # unix start, end


@dataclass(frozen=True)
class Row:
    """One minute of the soak (counts are the minute's; `real_refused` is cumulative)."""

    minute: int  # minutes since the service was ready, at the row's end
    at: str  # UTC, ISO 8601
    armed_min: float | None  # minutes since the rules armed (None: not armed yet)
    serve_rss_mb: float
    worker_rss_mb: float | None
    ok: int
    rejected_429: int
    errors: int  # no answer, or any status but 200 and 429
    p50_ms: float | None
    p99_ms: float | None
    real_refused: int  # tailwatch_admission_rejected_total{origin="real"} since start
    synthetic_refused: int  # the same for canaries and bursts
    firing: int
    resolved: int
    pages: int
    probe_cycles: int
    bursts: int
    rejected_in_bursts: int  # 429s to real requests due during a burst (+ BURST_GRACE_S)
    burst_window_s: float  # seconds of those windows that ended this minute
    # The minute's lowest RSS of its readings every TICK_S: a single reading moves with
    # where it falls between two heap trims and with the queue the minute holds; the
    # floor is what the process keeps across them.
    serve_rss_floor_mb: float | None = None
    worker_rss_floor_mb: float | None = None
    # What the worker's RSS holds at the minute's end (its tailwatch_process_memory_bytes):
    # SQLite's page caches and glibc malloc's blocks in use.
    worker_sqlite_mb: float | None = None
    worker_malloc_mb: float | None = None
    error_statuses: str | None = None  # the minute's errors by status, "0:2 504:1" (0: no answer)
    # The same heaps of the serving process (its own /metrics, scraped at the minute's end).
    serve_sqlite_mb: float | None = None
    serve_malloc_mb: float | None = None


COLUMNS = [f.name for f in fields(Row)]


def notification_counts(payloads: Iterable[Any]) -> tuple[int, int, int]:
    """Return (firing, resolved, pages) among generic-format payloads.

    An incident's notification counts by its `notification` kind and the incident's
    severity; a plain alert's by its status and severity. A page is a firing one of
    severity `page` (what wakes someone up).
    """
    firing = resolved = pages = 0
    for p in payloads:
        if not isinstance(p, dict):
            continue
        if p.get("kind") == "incident":
            inc = p.get("incident") or {}
            status, severity = inc.get("notification"), inc.get("severity")
        elif p.get("kind") == "alert":
            alert = p.get("alert") or {}
            status, severity = p.get("status"), alert.get("severity")
        else:
            continue
        if status == "firing":
            firing += 1
            pages += severity == "page"
        elif status == "resolved":
            resolved += 1
    return firing, resolved, pages


@dataclass(frozen=True)
class Answers:
    """A minute's real requests by answer."""

    ok: int
    rejected_429: int
    errors: int
    p50_ms: float | None  # of the 200s, client-side
    p99_ms: float | None
    rejected_in_bursts: int  # 429s to requests due within a burst window
    error_statuses: str = ""  # the errors by status, "0:2 504:1" (0: no answer)


def paged_rules(payload: Any) -> list[str]:
    """Return the rules a generic-format payload pages for (empty unless a firing page)."""
    if not isinstance(payload, dict) or notification_counts([payload])[2] == 0:
        return []
    if payload.get("kind") == "incident":
        members = (payload.get("incident") or {}).get("members") or []
        return sorted({str(m.get("rule")) for m in members if m.get("status") == "firing"})
    return [str((payload.get("alert") or {}).get("rule"))]


def armed_at(rows: Sequence[Row]) -> float | None:
    """Return the unix time the rules armed, from the first row that knows it."""
    for r in rows:
        if r.armed_min is not None:
            return datetime.fromisoformat(r.at).timestamp() - r.armed_min * 60
    return None


def answer_counts(answers: Sequence[Answer], bursts: Sequence[Window] = ()) -> Answers:
    """Return a minute's answers counted; `bursts` are the burst windows known so far."""
    ok = [a.latency_s * 1e3 for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    during = sum(any(lo <= a.due <= hi for lo, hi in bursts) for a in refused)
    errors = Counter(a.status for a in answers if a.status not in (200, 429))
    return Answers(ok=len(ok), rejected_429=len(refused),
                   errors=sum(errors.values()),
                   p50_ms=round(percentile(ok, 0.5), 1) if ok else None,
                   p99_ms=round(percentile(ok, 0.99), 1) if ok else None,
                   rejected_in_bursts=during,
                   error_statuses=" ".join(f"{k}:{n}" for k, n in sorted(errors.items())))


def burst_windows(samples: Samples) -> set[Window]:
    """Return the latest burst's window per suite from /metrics (start, end + grace)."""
    ends = {ls: v for (n, ls), v in samples.items()
            if n == "tailwatch_probe_last_run_timestamp_seconds" and ("kind", "burst") in ls}
    out = set()
    for labels, end in ends.items():
        took = samples.get(("tailwatch_probe_duration_seconds", labels), 0.0)
        if end > 0:
            out.add((end - took, end + BURST_GRACE_S))
    return out


def write_row(path: Path, row: Row) -> None:
    """Append `row` to the CSV at `path` (the header first when the file is new)."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})


def _cell(text: str, kind: Any) -> Any:
    if text == "":
        return None
    if "float" in str(kind):
        return float(text)
    if "int" in str(kind):
        return int(text)
    return text


def read_rows(path: Path) -> list[Row]:
    """Return the rows of a soak CSV (a run in progress included)."""
    kinds = {f.name: f.type for f in fields(Row)}
    with path.open(newline="") as f:
        return [Row(**{k: _cell(v, kinds[k]) for k, v in r.items()})
                for r in csv.DictReader(f) if r.get("minute")]


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """Return the least-squares slope of (minute, value) points, per hour (None: < 2 points)."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx * 60


@dataclass(frozen=True)
class Summary:
    """What a soak's rows add up to."""

    minutes: int
    serve_mb_per_h: float | None
    worker_mb_per_h: float | None
    serve_rss_mb: tuple[float, float] | None  # at the warm-up's end, at the last row
    last_hour_mb_per_h: tuple[float | None, float | None]  # serve, worker over the last 60 rows
    floor_mb_per_h: tuple[float | None, float | None]  # serve, worker: the minutes' floors
    armed_minutes: float  # minutes of the first hour after arming the rows cover (<= 60)
    pages_first_hour: int
    pages: int
    firing: int
    resolved: int
    ok: int
    rejected_429: int
    errors: int
    real_refused: int
    synthetic_refused: int
    probe_cycles: int
    bursts: int
    rejected_in_bursts: int
    burst_window_s: float
    # rule -> pages in the first hour after arming (from the receiver's log; {}: not read)
    first_hour_rules: dict[str, int] = field(default_factory=dict)
    page_rules: dict[str, int] = field(default_factory=dict)  # the same over the whole run
    # The worker's SQLite caches and malloc in use after the warm-up: (first, last) MB and
    # MB/h (None: the run's worker did not export them).
    worker_heaps: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)
    serve_heaps: dict[str, tuple[float, float, float | None]] = field(default_factory=dict)
    error_statuses: dict[int, int] = field(default_factory=dict)  # status (0: none) -> errors

    @property
    def expected_in_bursts(self) -> float:
        """Return the 429s the burst windows would hold at the rest of the run's 429 rate."""
        rest_s = self.minutes * 60 - self.burst_window_s
        if rest_s <= 0:
            return 0.0
        return (self.rejected_429 - self.rejected_in_bursts) / rest_s * self.burst_window_s

    def lines(self) -> list[str]:
        """Return the printed summary; the last three lines are the targets'."""
        def mbh(v: float | None) -> str:
            return "n/a (too short)" if v is None else f"{v:+.1f} MB/h"

        rss = ("" if self.serve_rss_mb is None else
               f" ({self.serve_rss_mb[0]:.0f} -> {self.serve_rss_mb[1]:.0f} MB)")
        hour = ("" if self.armed_minutes >= ARMED_HOUR else
                f" (only {self.armed_minutes:.0f} of its 60 minutes so far)")
        total = self.ok + self.rejected_429 + self.errors
        share = self.rejected_429 / total if total else 0.0
        saturated = ([f"saturated: {share:.0%} of the real requests were answered 429 (the "
                      "engine did not carry the rate on this host; latency and rejection "
                      "rules page on that, rightly)"] if share > SATURATED_SHARE else [])
        return [*saturated,
            f"minutes: {self.minutes}; real requests: {self.ok} ok, {self.rejected_429} "
            f"answered 429, {self.errors} other errors{_statuses(self.error_statuses)}; "
            f"probe cycles {self.probe_cycles}, "
            f"bursts {self.bursts}",
            f"notifications: {self.firing} firing ({self.pages} pages{_rules(self.page_rules)}), "
            f"{self.resolved} "
            f"resolved; admission refused {self.real_refused} real, "
            f"{self.synthetic_refused} synthetic",
            *[f"{who}'s heaps after {WARM_MINUTES} min: " + ", ".join(
                f"{name} {a:.1f} -> {b:.1f} MB ({mbh(slope)})"
                for name, (a, b, slope) in heaps.items())
              for who, heaps in (("serve", self.serve_heaps), ("worker", self.worker_heaps))
              if heaps],
            f"rss growth after {WARM_MINUTES} min: serve {mbh(self.serve_mb_per_h)}{rss}, "
            f"worker {mbh(self.worker_mb_per_h)} (least squares; target < 5 MB/h)"
            + (f"; floors: serve {mbh(self.floor_mb_per_h[0])}, worker "
               f"{mbh(self.floor_mb_per_h[1])}" if self.floor_mb_per_h[0] is not None else "")
            + (f"; over the last hour: serve {mbh(self.last_hour_mb_per_h[0])}, worker "
               f"{mbh(self.last_hour_mb_per_h[1])}" if self.minutes >= 2 * ARMED_HOUR else ""),
            f"pages in the first hour after the rules armed: {self.pages_first_hour}{hour}"
            + (f" ({_rules(self.first_hour_rules)[2:]})" if self.first_hour_rules else "")
            + " (target 0)",
            f"real requests shed by probes: {self.rejected_in_bursts} (429 answers to real "
            f"requests due during the {self.bursts} bursts' {self.burst_window_s:.0f} s, "
            f"{self.expected_in_bursts:.1f} expected there at the other 429s' rate; "
            "target 0)",
        ]


def _statuses(counts: dict[int, int]) -> str:
    if not counts:
        return ""
    return " (" + ", ".join(f"{n} {'no answer' if k == 0 else k}"
                            for k, n in sorted(counts.items())) + ")"


def _error_statuses(rows: Sequence[Row]) -> dict[int, int]:
    out: Counter[int] = Counter()
    for r in rows:
        for item in (r.error_statuses or "").split():
            status, n = item.split(":")
            out[int(status)] += int(n)
    return dict(out)


def _rules(counts: dict[str, int]) -> str:
    return "".join(f"; {rule} x{n}" for rule, n in sorted(counts.items()))


def summarize(rows: Sequence[Row],
              notifications: Sequence[tuple[float, Any]] = ()) -> Summary:
    """Return the summary of a soak's rows; `notifications` (time, payload) name the pages."""
    armed = armed_at(rows)
    rules: Counter[str] = Counter()
    every: Counter[str] = Counter()
    for at, payload in notifications:
        every.update(paged_rules(payload))
        if armed is not None and 0 <= at - armed < ARMED_HOUR * 60:
            rules.update(paged_rules(payload))
    warm = [r for r in rows if r.minute >= WARM_MINUTES]
    serve = [(float(r.minute), r.serve_rss_mb) for r in warm]
    worker = [(float(r.minute), r.worker_rss_mb) for r in warm if r.worker_rss_mb is not None]
    first_hour = [r for r in rows if r.armed_min is not None and 0 < r.armed_min <= ARMED_HOUR]
    floors = tuple(slope_per_hour([(float(r.minute), v) for r in warm
                                   if (v := getattr(r, f"{p}_rss_floor_mb")) is not None])
                   for p in ("serve", "worker"))
    last = rows[-1] if rows else None
    return Summary(
        minutes=last.minute if last else 0,
        serve_mb_per_h=slope_per_hour(serve),
        worker_mb_per_h=slope_per_hour(worker),
        serve_rss_mb=(warm[0].serve_rss_mb, warm[-1].serve_rss_mb) if warm else None,
        last_hour_mb_per_h=(slope_per_hour(serve[-ARMED_HOUR:]),
                            slope_per_hour(worker[-ARMED_HOUR:])),
        floor_mb_per_h=(floors[0], floors[1]),
        armed_minutes=float(len(first_hour)),
        pages_first_hour=sum(r.pages for r in first_hour),
        pages=sum(r.pages for r in rows),
        firing=sum(r.firing for r in rows),
        resolved=sum(r.resolved for r in rows),
        ok=sum(r.ok for r in rows),
        rejected_429=sum(r.rejected_429 for r in rows),
        errors=sum(r.errors for r in rows),
        real_refused=last.real_refused if last else 0,
        synthetic_refused=last.synthetic_refused if last else 0,
        probe_cycles=sum(r.probe_cycles for r in rows),
        bursts=sum(r.bursts for r in rows),
        rejected_in_bursts=sum(r.rejected_in_bursts for r in rows),
        burst_window_s=sum(r.burst_window_s for r in rows),
        first_hour_rules=dict(rules),
        page_rules=dict(every),
        worker_heaps=_heaps(warm, "worker"),
        serve_heaps=_heaps(warm, "serve"),
        error_statuses=_error_statuses(rows),
    )


def _heaps(warm: Sequence[Row], who: str) -> dict[str, tuple[float, float, float | None]]:
    out = {}
    for name, column in (("sqlite", f"{who}_sqlite_mb"), ("malloc in use", f"{who}_malloc_mb")):
        points = [(float(r.minute), v) for r in warm if (v := getattr(r, column)) is not None]
        if points:
            out[name] = (points[0][1], points[-1][1], slope_per_hour(points))
    return out


def _lower(low: float | None, value: float | None) -> float | None:
    """Return the lower of a floor and a reading (a missing one does not count)."""
    return value if low is None or (value is not None and value < low) else low


class Recorder:
    """Turn the service's scrapes, the receiver's payloads and the traffic into rows."""

    def __init__(self, svc: ServiceProcess, rx: WebhookReceiver, traffic: PoissonTraffic,
                 ready: float, rules: Sequence[Rule] = ()) -> None:
        self.svc, self.rx, self.traffic, self.ready = svc, rx, traffic, ready
        self.rules = list(rules)  # the service's: their arming is polled (rules_armed)
        self.armed: float | None = None
        self.next_poll = 0.0
        self.windows: set[Window] = set()
        self.counted: set[Window] = set()
        self.seen = 0
        self.first_probe: float | None = None
        self.serve_scrape: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.before = self.counters()
        self.floor: tuple[float | None, float | None] = (None, None)

    def sample_rss(self) -> tuple[int, int | None]:
        """Read both processes' RSS now and lower the minute's floors to it."""
        serve, worker = self.svc.rss()
        self.floor = (_lower(self.floor[0], serve), _lower(self.floor[1], worker))
        return serve, worker

    def counters(self) -> dict[str, float]:
        """Scrape the serving process: job counts, admission refusals; note burst windows."""
        m = self.svc.metrics()
        self.serve_scrape = m  # its heaps go into the minute's row (`heaps`)
        self.windows |= burst_windows(m)
        return {
            "probe": metric_sum(m, "tailwatch_job_duration_seconds_count",
                                scheduled_job="probe"),
            "burst": metric_sum(m, "tailwatch_job_duration_seconds_count",
                                scheduled_job="burst"),
            "real_refused": metric_sum(m, "tailwatch_admission_rejected_total", origin="real"),
            "synthetic_refused": metric_sum(m, "tailwatch_admission_rejected_total",
                                            origin="synthetic"),
        }

    def wait(self, until: float) -> None:
        """Sleep until `until`; meanwhile note the first probe cycle and poll the arming."""
        while time.time() < until:
            time.sleep(min(TICK_S, max(0.0, until - time.time())))
            if self.first_probe is None and self.counters()["probe"] > 0:
                self.first_probe = time.time()
            if self.first_probe is not None and self.armed is None \
                    and time.time() >= self.next_poll:
                self.next_poll = time.time() + ARM_POLL_S
                self.poll_arming()
            self.sample_rss()

    def heaps(self) -> dict[str, float | None]:
        """Return both processes' SQLite and malloc heaps in MB (None: not exported); the
        serving process's from the scrape `counters` just made."""
        out: dict[str, float | None] = {}
        for who, m in (("worker", self.svc.worker_metrics()), ("serve", self.serve_scrape)):
            for kind, column in (("sqlite", "sqlite"), ("malloc_in_use", "malloc")):
                value = m.get(("tailwatch_process_memory_bytes", frozenset({("kind", kind)})))
                out[f"{who}_{column}_mb"] = None if value is None else round(value / 1e6, 1)
        return out

    def poll_arming(self) -> None:
        """Ask the service whether its rules armed (a failed read is tried again later)."""
        armed = rules_armed(self.svc, self.rules)
        if armed:
            self.armed = min(armed.values())

    def row(self, minute: int) -> Row:
        """Return the minute's row (counts since the previous one)."""
        now = self.counters()
        deliveries = [d.body for d in self.rx.deliveries()]
        firing, resolved, pages = notification_counts(deliveries[self.seen:])
        self.seen = len(deliveries)
        answers = answer_counts(self.traffic.drain(), sorted(self.windows))
        new_windows = self.windows - self.counted
        self.counted |= new_windows
        serve_rss, worker_rss = self.sample_rss()
        (serve_floor, worker_floor), self.floor = self.floor, (None, None)
        armed = None if self.armed is None else round((time.time() - self.armed) / 60, 2)
        row = Row(
            minute=minute, at=datetime.now(UTC).isoformat(timespec="seconds"), armed_min=armed,
            serve_rss_mb=round(serve_rss / 1e6, 1),
            worker_rss_mb=None if worker_rss is None else round(worker_rss / 1e6, 1),
            ok=answers.ok, rejected_429=answers.rejected_429, errors=answers.errors,
            error_statuses=answers.error_statuses or None,
            p50_ms=answers.p50_ms, p99_ms=answers.p99_ms,
            real_refused=int(now["real_refused"]),
            synthetic_refused=int(now["synthetic_refused"]),
            firing=firing, resolved=resolved, pages=pages,
            probe_cycles=int(now["probe"] - self.before["probe"]),
            bursts=int(now["burst"] - self.before["burst"]),
            rejected_in_bursts=answers.rejected_in_bursts,
            burst_window_s=round(sum(hi - lo for lo, hi in new_windows), 2),
            serve_rss_floor_mb=None if serve_floor is None else round(serve_floor / 1e6, 1),
            worker_rss_floor_mb=None if worker_floor is None else round(worker_floor / 1e6, 1),
            **self.heaps())
        self.before = now
        return row


def run(folder: Path, minutes: int, rate: float) -> Path:
    """Run the soak, appending a row per minute to `folder`/soak.csv; return the CSV path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "soak.csv"
    if out.exists():
        raise SystemExit(f"--folder: {out} exists; choose another folder")
    with WebhookReceiver(log_file=folder / "notifications.jsonl") as rx:
        settings = settings_for(folder, rx.url, probe_interval_s=10, evaluate_interval_s=10)
        print(f"starting tailwatch serve (log {folder / 'serve.log'})", flush=True)
        with ServiceProcess(folder, settings) as svc:
            ready = time.time()
            print(f"ready at {datetime.now(UTC):%H:%M:%S} UTC; serve pid {svc.pid}; "
                  f"{rate:g} requests/s for {minutes} min; rows -> {out}", flush=True)
            traffic = PoissonTraffic(svc.url, rate_per_s=rate, token=svc.token)
            traffic.start()
            try:
                rec = Recorder(svc, rx, traffic, ready, load_rules())  # shipped, as served
                for minute in range(1, minutes + 1):
                    rec.wait(ready + minute * 60)
                    row = rec.row(minute)
                    write_row(out, row)
                    print(json.dumps(asdict(row)), flush=True)
            finally:
                traffic.stop()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Run the soak (or summarize a CSV) and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=120)
    ap.add_argument("--rate", type=float, default=10.0, help="real requests per second")
    ap.add_argument("--folder", type=Path, default=Path("var/soak-run"))
    ap.add_argument("--summarize", type=Path, default=None, metavar="CSV",
                    help="print the summary of a soak CSV (a run in progress too) and exit")
    args = ap.parse_args(argv)
    if args.summarize is not None:
        if not args.summarize.is_file():
            raise SystemExit(f"--summarize: {args.summarize} is no file")
        path = args.summarize
    else:
        if args.minutes < 1 or not math.isfinite(args.rate) or args.rate <= 0:
            raise SystemExit("--minutes must be >= 1 and --rate > 0")
        signal.signal(signal.SIGTERM, stop_on_sigterm)
        path = run(args.folder, args.minutes, args.rate)
    log = path.parent / "notifications.jsonl"
    notifications = read_posts(log)
    for line in summarize(read_rows(path), notifications).lines():
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
