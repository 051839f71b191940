"""Fault runs against the real service: nothing lost, nothing duplicated.

Three faults, each on the production wiring (`monitor.app.create_app` and its lifespan:
outbox + Deliverer, storage Writer, Prober, traffic recorder), with a fake engine behind
the runtime's own flag guard (`engine.flags.GuardedFlags`: last known flags when the
database is away) and compressed time where the code takes a clock:

  webhooks   the receiver refuses connections, then hangs (accepts, never answers in
             time), then recovers, while alerts fire and resolve (alerts.lifecycle) and
             report messages are queued; a second, healthy receiver runs all along.
             Counts outbox rows sent vs received (2xx, HMAC checked), duplicates.
  database   PostgreSQL behind a loopback TCP proxy that is cut, then restored, while
             requests are served and probe cycles run. Counts requests answered, probe
             runs and results produced vs stored, and served requests vs stored rollups.
  kill9      a child process runs probe cycles through the Writer into SQLite and prints
             each cycle once the Writer has committed it; it is `kill -9`ed at random
             moments, again and again. Then `PRAGMA integrity_check` and the stored vs
             acknowledged cycles.

Run (a few minutes; PostgreSQL at 127.0.0.1:5432 for `database`, skipped if absent):
    taskset -c 1 .venv/bin/python -m bench.faults [--quick] [--only webhooks,kill9]
Last line: `lost: N, duplicated: M` over notifications and results (target: 0 and 0).
A superseded firing (its resolved went in its place, by design) is reported, not lost.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.proxy import TcpProxy
from monitor.loopback import WebhookReceiver, wait_for

PG_ADMIN_URL = os.environ.get(
    "TAILWATCH_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SECRET = "bench-faults-hmac"
TOKEN = "bench-faults-token-0001"
WORDS = "the river runs past the old stone house and on into the green field "


@dataclass(frozen=True)
class Config:
    """How long each fault lasts (rounds of the compressed clock) and how much runs."""

    refuse_rounds: int = 12  # webhooks: connections refused
    hang_rounds: int = 8  # webhooks: accepted, no answer within the timeout
    drain_rounds: int = 80  # webhooks: at most this many rounds to drain after recovery
    step_s: float = 20.0  # simulated seconds per webhook round
    hook_timeout_s: float = 0.25  # the targets' HTTP timeout (real seconds)
    hang_s: float = 0.6  # how long the hanging receiver stalls before a 503
    db_rounds: tuple[int, int, int] = (4, 12, 4)  # database: up, cut, restored
    db_down_s: float = 60.0  # the cut lasts at least this long (real seconds; rounds go on)
    requests_per_round: int = 20
    kills: int = 12
    kill_after_s: tuple[float, float] = (0.05, 1.0)  # kill moment after the first ack
    seed: int = 7

    @classmethod
    def quick(cls) -> Config:
        """Return a small configuration (tests, smoke runs): seconds, not minutes."""
        return cls(refuse_rounds=3, hang_rounds=2, drain_rounds=40, db_rounds=(2, 3, 2),
                   db_down_s=1.0,
                   requests_per_round=5, kills=3, kill_after_s=(0.05, 0.5))


@dataclass
class Outcome:
    """What one fault run counted; `lost` and `duplicated` sum into the last line."""

    name: str
    lost: int = 0
    duplicated: int = 0
    lines: list[str] = field(default_factory=list)
    skipped: str | None = None
    counts: dict[str, int] = field(default_factory=dict)  # what the lines say, for tests

    def say(self, text: str) -> None:
        """Add one line to the report of this run."""
        self.lines.append(text)


class SimClock:
    """A clock the bench moves by hand (the app's `clock` seam)."""

    def __init__(self, now: datetime = T0) -> None:
        self._now = now
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by `seconds`."""
        with self._lock:
            self._now += timedelta(seconds=seconds)


# -- the service on a fake engine ---------------------------------------------------------

class _GuardedProvider:
    """The runtime's flag guard as a FlagProvider (never raises: last known flags)."""

    def __init__(self, provider: Any) -> None:
        from engine.flags import GuardedFlags

        self._provider = provider
        self._guard = GuardedFlags(provider, timeout_s=0.5)

    def flags(self) -> Any:
        return self._guard.read()

    def invalidate(self) -> None:
        self._provider.invalidate()


def engine_factory(config: Any, flags: Any) -> Any:
    """Build a fake engine reading flags through the runtime's guard."""
    from probes.fake import FakeEngine

    return FakeEngine(buckets=config.buckets, max_input_tokens=config.max_input_tokens,
                      flags=_GuardedProvider(flags), output_tokens=8)


def suites() -> dict[str, Any]:
    """Return one small canary suite covering buckets 16, 32 and 64."""
    from probes.canaries import CanarySuite

    prompts = tuple(WORDS[:n].strip() for n in (8, 12, 24, 28, 50, 60))
    return {"in_domain": CanarySuite("in_domain", "in_domain", prompts)}


def make_settings(database_url: str, **overrides: Any) -> Any:
    """Return service settings for the runs: small buckets, no scheduler (the bench drives jobs)."""
    from monitor.settings import Settings

    values: dict[str, Any] = {
        "database_url": database_url, "instance_id": "bench-faults", "api_token": TOKEN,
        "engine": {"buckets": (16, 32, 64), "max_input_tokens": 128, "max_new_tokens": 8},
        "scheduler": {"enabled": False},
        "probes": {"suite": "in_domain", "canaries_per_bucket": 2},
    }
    values.update(overrides)
    return Settings(**values)


@contextlib.contextmanager
def service(settings: Any, clock: Callable[[], datetime] | None = None) -> Iterator[Any]:
    """Run the app's lifespan; yield (TestClient, Services) once the engine is warm."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from monitor.app import create_app
    from monitor.hub import services_of

    app = create_app(settings, engine_factory=engine_factory, registry=CollectorRegistry(),
                     suites=suites(), clock=clock)
    with TestClient(app) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, 30, interval_s=0.02,
                 what="the service ready")
        yield client, services_of(app)


def _sqlite_url(workdir: Path, name: str) -> str:
    from storage.migrate import upgrade

    url = f"sqlite:///{workdir / name}"
    upgrade(url)
    return url


# -- fault 1: the webhook receiver refuses, hangs, recovers -------------------------------

def run_webhooks(cfg: Config, workdir: Path) -> Outcome:
    """Alerts fire and resolve while one receiver is down, then hanging, then back."""
    from sqlalchemy import func, select

    from alerts.lifecycle import Lifecycle, fingerprint, open_alerts
    from alerts.outbox import enqueue_message
    from alerts.rules import RuleResult
    from monitor.jobs import scheduled_jobs
    from storage.models import WebhookDelivery
    from storage.queries.deliveries import pending_count

    out = Outcome("webhooks")
    flaky = WebhookReceiver(secret=SECRET)  # refuses connections until started
    healthy = WebhookReceiver(secret=SECRET)
    healthy.start()
    hooks = [{"name": name, "url": rx.url, "format": "alertmanager", "secret": SECRET,
              "timeout": cfg.hook_timeout_s, "messages": True}
             for name, rx in (("flaky", flaky), ("healthy", healthy))]
    settings = make_settings(_sqlite_url(workdir, "webhooks.db"),
                             alerts={"webhooks": hooks})
    clock = SimClock()
    rounds = {"refuse": 0, "hang": 0, "drain": 0}
    with service(settings, clock) as (_, services):
        deliver = scheduled_jobs(services)["delivery"]
        a = services.alerts
        rule = a.rules[0]
        fired: list[dict[str, str]] = []

        def produce(i: int) -> None:
            with services.sessions.begin() as s:
                life = Lifecycle(s, clock(), a.targets, external_url=a.external_url)
                labels = {"bucket": str(16 << (i % 3)), "canary": f"c{i}"}
                life.apply(rule, RuleResult(rule.name, labels, 1.0, 1.4, 0.4, 0.15, True,
                                            "bench: fired", breaching=True, severity=rule.severity), None)
                fired.append(labels)
                if i >= 3:  # the alert fired three rounds ago recovers
                    old = fired[i - 3]
                    alert = open_alerts(s).get(fingerprint(rule.name, old))
                    life.apply(rule, RuleResult(rule.name, old, 1.0, 1.0, 0.0, 0.15, False,
                                                "bench: recovered", recovered=True, severity=rule.severity), alert)
                if i % 5 == 0:
                    enqueue_message(s, "Weekly report", f"bench message {i}", a.targets,
                                    now=clock(), key=f"bench-report-{i}")

        i = 0
        for phase, n in (("refuse", cfg.refuse_rounds), ("hang", cfg.hang_rounds)):
            if phase == "hang":
                flaky.default = ("sleep", cfg.hang_s)  # accepts, answers past the timeout
                flaky.start()
            for _ in range(n):
                produce(i)
                i += 1
                clock.advance(cfg.step_s)
                deliver()
                rounds[phase] += 1
        flaky.default = 200  # recovered: new notifications keep coming for a few rounds
        for r in range(cfg.drain_rounds):
            if r < 3:
                produce(i)
                i += 1
            clock.advance(cfg.step_s)
            deliver()
            rounds["drain"] += 1
            with services.sessions() as s:
                if r >= 3 and pending_count(s) == 0:
                    break
            time.sleep(0.01)
        with contextlib.suppress(TimeoutError):  # a hanging drain may still be running
            wait_for(lambda: not services.deliverer._running, 10, interval_s=0.05)
        with services.sessions() as s:
            rows = s.execute(select(WebhookDelivery.target, WebhookDelivery.idempotency_key,
                                    WebhookDelivery.state)).all()
            max_attempts = s.scalar(select(func.max(WebhookDelivery.attempts))) or 0
    flaky.stop()
    healthy.stop()
    for name, rx in (("flaky", flaky), ("healthy", healthy)):
        mine = [(k, st) for t, k, st in rows if t == name]
        received = sum(1 for k, _ in mine if rx.accepted[k] > 0)
        superseded = sum(1 for k, st in mine if st == "superseded" and rx.accepted[k] == 0)
        lost = len(mine) - received - superseded
        dup = sum(n - 1 for n in rx.accepted.values() if n > 1)
        states = Counter(st for _, st in mine)
        out.lost += lost
        out.duplicated += dup
        out.say(f"{name:8} sent {len(mine)}, received {received}, superseded {superseded} "
                f"(a resolved replaced its undelivered firing), lost {lost}, duplicated {dup}, "
                f"bad signatures {rx.bad_signatures}, requests {len(rx.deliveries())}; "
                f"outbox states {dict(states)}")
        out.lost += rx.bad_signatures  # an unverifiable notification is as good as lost
        out.counts.update({f"{name}_sent": len(mine), f"{name}_received": received,
                           f"{name}_requests": len(rx.deliveries())})
    out.counts["max_attempts"] = max_attempts
    out.say(f"rounds of {cfg.step_s:g} simulated s: refused {rounds['refuse']}, hanging "
            f"{rounds['hang']} (each attempt a real {cfg.hook_timeout_s:g} s timeout), then "
            f"drained in {rounds['drain']}; most attempts on one row {max_attempts}")
    return out


# -- fault 2: the database goes away under requests and probe cycles ----------------------

@contextlib.contextmanager
def _pg_database(admin_url: str) -> Iterator[str]:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from storage.db import make_engine

    name = f"tailwatch_faults_{uuid.uuid4().hex[:8]}"
    admin = make_engine(admin_url, connect_timeout_s=3)
    try:
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        yield url
    finally:
        with contextlib.suppress(Exception), \
                admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_database(cfg: Config, admin_url: str = PG_ADMIN_URL) -> Outcome:
    """Cut PostgreSQL (a proxy) while requests are served and probe cycles run."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    out = Outcome("database")
    try:
        db = _pg_database(admin_url)
        real_url = db.__enter__()
    except OperationalError as exc:
        out.skipped = f"PostgreSQL unreachable ({str(exc.orig).splitlines()[0]})"
        return out
    try:
        _database_run(cfg, real_url, out, make_url)
    finally:
        db.__exit__(None, None, None)
    return out


def _database_run(cfg: Config, real_url: str, out: Outcome, make_url: Any) -> None:
    from sqlalchemy import func, select

    from monitor.jobs import scheduled_jobs
    from probes.cycle import CycleResult
    from storage.db import make_engine, make_sessionmaker
    from storage.migrate import upgrade
    from storage.models import ProbeResult, ProbeRun, TrafficRollup

    upgrade(real_url)
    real = make_url(real_url)
    proxy = TcpProxy((real.host or "127.0.0.1", real.port or 5432))
    proxy.start()
    url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    # Output quality off: its agreement rows read the database while checking; the counts
    # here follow the cycle's own writes (runs, results) and the traffic rollups.
    settings = make_settings(url, quality={"enabled": False})
    asked = answered = cycles = results = 0
    failed: Counter[str] = Counter()
    up, cut, back = cfg.db_rounds
    done: Counter[str] = Counter()
    down_s = 0.0
    with service(settings) as (client, services):
        jobs = scheduled_jobs(services)
        for phase, n in (("up", up), ("cut", cut), ("back", back)):
            if phase == "cut":
                proxy.stop()
                down_s = time.perf_counter()
            elif phase == "back":
                proxy.start()
                down_s = time.perf_counter() - down_s
            r = 0
            # The writer's backoff reaches its cap (5 s) during a long enough cut.
            while r < n or (phase == "cut" and time.perf_counter() - down_s < cfg.db_down_s):
                if r >= n:
                    time.sleep(1.0)  # past the scripted rounds: one round a second
                r += 1
                for k in range(cfg.requests_per_round):
                    asked += 1
                    resp = client.post("/v1/generate",
                                       json={"text": WORDS[:8 + (r * 7 + k * 13) % 60]})
                    if resp.status_code == 200:
                        answered += 1
                    else:
                        failed[f"{phase} {resp.status_code}"] += 1
                result = jobs["probe"]()
                if isinstance(result, CycleResult):
                    cycles += 1
                    results += len(result.groups)
                else:
                    failed[f"{phase} probe skipped"] += 1
                jobs["traffic_flush"]()
                done[phase] += 1
        drained = services.writer.flush(timeout=60)
        stats = services.writer.stats
    proxy.stop()
    db = make_engine(real_url)
    try:
        with make_sessionmaker(db)() as s:
            runs = s.scalar(select(func.count()).select_from(ProbeRun)) or 0
            distinct = s.scalar(select(func.count(func.distinct(ProbeRun.started_at)))) or 0
            stored = s.scalar(select(func.count()).select_from(ProbeResult)) or 0
            rolled = s.scalar(select(func.sum(TrafficRollup.requests))) or 0
    finally:
        db.dispose()
    lost = max(0, cycles - distinct) + max(0, results - stored) + max(0, answered - rolled)
    dup = (runs - distinct) + max(0, stored - results) + max(0, rolled - answered)
    out.lost += lost + (asked - answered)  # an unanswered request is a lost result too
    out.duplicated += dup
    out.counts.update(asked=asked, answered=answered, cycles=cycles, results=results,
                      writer_retries=stats.retries)
    out.say(f"requests answered {answered} of {asked}" + (f" (failed: {dict(failed)})"
                                                          if failed else ""))
    out.say(f"probe cycles stored {distinct} of {cycles}, probe results stored {stored} of "
            f"{results}, served requests in stored rollups {rolled} of {answered}")
    out.say(f"rounds up/cut/restored {done['up']}/{done['cut']}/{done['back']} (database "
            f"away {down_s:.1f} s); "
            f"writer drained {drained}, retries "
            f"{stats.retries}, dropped {stats.dropped}, failed {stats.failed}")


# -- fault 3: kill -9 while writing to SQLite ---------------------------------------------

def child_writer(url: str, instance: str) -> None:
    """Run probe cycles into `url` for ever, printing each one once it is committed."""
    from probes.fake import FakeEngine
    from probes.prober import prober_from_settings
    from probes.settings import ProbeSettings
    from storage.db import make_engine, make_sessionmaker
    from storage.writer import Writer

    writer = Writer(make_sessionmaker(make_engine(url)))
    engine = FakeEngine(buckets=(16, 32, 64), max_input_tokens=128, output_tokens=8)
    prober = prober_from_settings(ProbeSettings(suite="in_domain", canaries_per_bucket=2),
                                  engine, writer, instance_id=instance, suites=suites())
    while True:
        result = prober.run_cycle()
        if writer.flush(timeout=30):  # committed: acknowledge
            print("ack", result.started_at.isoformat(), flush=True)


def _acked_or_gone(proc: subprocess.Popen[str], lines: list[str]) -> bool:
    return any(ln.startswith("ack ") for ln in lines) or proc.poll() is not None


def run_kill9(cfg: Config, workdir: Path) -> Outcome:
    """kill -9 a process writing probe cycles to SQLite `cfg.kills` times; check the file."""
    from sqlalchemy import func, select, text

    from storage.db import make_engine, make_sessionmaker
    from storage.models import ProbeResult, ProbeRun

    out = Outcome("kill9")
    url = _sqlite_url(workdir, "kill9.db")
    rng = random.Random(cfg.seed)
    acked: dict[str, set[str]] = {}
    for n in range(cfg.kills):
        instance = f"kill-{n}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.faults", "--child-writer", url, instance],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        assert proc.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
        reader.start()
        # Killed at a random moment after its first acknowledged cycle (each kill then
        # has something to lose), mid-cycle or mid-commit as it falls.
        with contextlib.suppress(TimeoutError):  # a child that never acks is killed anyway
            wait_for(functools.partial(_acked_or_gone, proc, lines), 60)
        time.sleep(rng.uniform(*cfg.kill_after_s))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(5)
        proc.stdout.close()
        acked[instance] = {ln.split()[1] for ln in lines if ln.startswith("ack ")
                           and ln.endswith("\n")}
    db = make_engine(url)
    try:
        with db.connect() as conn:
            check = [r[0] for r in conn.execute(text("PRAGMA integrity_check"))]
        with make_sessionmaker(db)() as s:
            stored = [(i, at) for i, at in s.execute(
                select(ProbeRun.instance_id, ProbeRun.started_at))]
            orphans = s.scalar(select(func.count()).select_from(ProbeResult).where(
                ProbeResult.run_id.not_in(select(ProbeRun.id)))) or 0
    finally:
        db.dispose()
    seen = Counter((i, _iso(at)) for i, at in stored)
    lost = sum(1 for i, keys in acked.items() for k in keys if seen[(i, k)] == 0)
    dup = sum(n - 1 for n in seen.values() if n > 1)
    n_acked = sum(len(k) for k in acked.values())
    out.lost += lost + (0 if check == ["ok"] else 1)
    out.counts.update(acknowledged=n_acked, stored=len(stored), integrity_ok=check == ["ok"])
    out.duplicated += dup
    out.say(f"kill -9 x {cfg.kills}: integrity_check {check[0] if len(check) == 1 else check}; "
            f"cycles acknowledged {n_acked}, stored {len(stored)} (>= acknowledged: a cycle "
            f"committed just before its kill is stored, not acknowledged), acknowledged but "
            f"missing {lost}, duplicated {dup}, results without their run {orphans}")
    return out


def _read_lines(stream: Any, lines: list[str]) -> None:
    lines.extend(iter(stream.readline, ""))


def _iso(at: datetime) -> str:
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).isoformat()


# -- main ----------------------------------------------------------------------------------

RUNS = ("webhooks", "database", "kill9")


def run_all(cfg: Config, only: tuple[str, ...] = RUNS,
            admin_url: str = PG_ADMIN_URL) -> list[Outcome]:
    """Run the selected faults; return their outcomes in order."""
    outs = []
    with tempfile.TemporaryDirectory(prefix="tailwatch-faults-") as tmp:
        for name in only:
            started = time.perf_counter()
            if name == "webhooks":
                o = run_webhooks(cfg, Path(tmp))
            elif name == "database":
                o = run_database(cfg, admin_url)
            else:
                o = run_kill9(cfg, Path(tmp))
            o.say(f"({time.perf_counter() - started:.1f} s wall)")
            outs.append(o)
    return outs


def report(outs: list[Outcome]) -> tuple[int, int]:
    """Print each run's lines and the last line; return (lost, duplicated)."""
    for o in outs:
        print(f"== {o.name}" + (f": skipped, {o.skipped}" if o.skipped else ""))
        for line in o.lines:
            print("  " + line)
    lost = sum(o.lost for o in outs)
    dup = sum(o.duplicated for o in outs)
    print(f"lost: {lost}, duplicated: {dup}")
    return lost, dup


def main(argv: list[str] | None = None) -> int:
    """Run the fault benchmark (or, internally, the kill -9 child)."""
    p = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (seconds)")
    p.add_argument("--only", default=",".join(RUNS), help=f"comma-separated of {RUNS}")
    p.add_argument("--child-writer", nargs=2, metavar=("URL", "INSTANCE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_writer:
        child_writer(*args.child_writer)
        return 0
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = set(only) - set(RUNS)
    if unknown:
        p.error(f"--only: unknown run(s) {sorted(unknown)}; known: {', '.join(RUNS)}")
    cfg = Config.quick() if args.quick else Config()
    print(json.dumps({"config": {k: v for k, v in vars(cfg).items()}}, default=str))
    lost, dup = report(run_all(cfg, only))
    return 0 if lost == 0 and dup == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
