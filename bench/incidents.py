"""Incidents replayed through the real evaluator, lifecycle, policy and outbox (SQLite).

Each scenario writes the rows the probes would write (canary cycles, real-traffic compile
events) one minute at a time into a fresh migrated SQLite file, and runs
`alerts.evaluator.evaluate` with the shipped rules and policy just after each cycle, on an
injected clock (no sleeping). Notifications are the outbox rows the lifecycle queues for
one webhook target; flags are what the policy wrote (and what the engine of each
instance would read).

Noise: per-cycle canary p99s recorded from the engine (bench/data/canary_noise.json,
each bucket's cycles divided by its median), resampled in moving blocks of 5 cycles so
their autocorrelation stays (i.i.d. resampling hides flapping and false alarms). The
recording (10 canaries per bucket on the compiled path, of which each cycle here takes
the probes' `canaries_per_bucket`, 4) was made pinned to an otherwise idle core; by
default the log-deviations are scaled to a 10% robust CV, a dedicated host; `--raw` keeps
them as recorded.

Scenarios: step shifts of +10/+20/+30/+50% lasting 5, 15 and 60 minutes (the canary p99
rule, threshold +15%); slow ramps; an instance that dies with an alert open; a 6-hour
recompile storm on one instance (recompiles_per_hour / compile_failures and the eager
fallback); a two-version rollout (i2 moves to m2, 20% or 50% slower, for an hour, then
back); a daily peak (+25% for two hours every day) with the rule's hour-of-week baseline
after 14, 7 and 2 days of history (counted; before two weeks the hour of the day stands
in) and without it (shown, not counted: against a flat baseline a +25% peak is a +25%
change, which is what `seasonality` is for); 6 quiet hours. Printed per scenario: pages (firing alerts of
severity page) and notifications, detection delay, time to resolve after the end, flag
timeline. A page is the incident's when it fires between its start and an hour after its
end; any other page is false. The last line:

    pages per incident: max N, false pages per 30 days: M

    python -m bench.incidents [--seed 0] [--raw] [--quick] [--daily-seeds N]

`--service` replays whole-service scenarios instead (every shipped rule and bucket at
once, pages counted per incident, the stated cause checked; bench.service_incidents),
on the recorded noise unless `--scaled`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from alerts.baselines import BaselineConfig
from alerts.flags import FlagStore
from alerts.policy import Policy, load_policy
from alerts.rule_file import load_rules
from alerts.rules import Rule
from alerts.webhooks import WebhookTarget
from bench.replay import T0, Replay, minute
from probes.cycle import CANARIES_PER_BUCKET
from probes.settings import ProbeSettings
from storage import migrate
from storage.models import (
    Alert,
    AlertTransition,
    CompileEvent,
    FlagAudit,
    ProbeResult,
    ProbeRun,
    WebhookDelivery,
)
from storage.sketches import Sketch

NOISE_FILE = Path(__file__).parent / "data" / "canary_noise.json"
HISTORY = 360  # quiet cycles before a scenario: a deployment's first six hours
GRACE = 60  # minutes after an incident's end that its pages still belong to it
MINUTES_30_DAYS = 30 * 24 * 60
TARGET = WebhookTarget(name="oncall", url="http://127.0.0.1:9/hook", format="alertmanager")
STORM_RECOMPILES_PER_MIN = 3  # real traffic's shape churn while compiled is on

class BlockNoise:
    """Moving-block bootstrap of recorded canary cycles (per-request latency factors)."""

    def __init__(self, sample: dict, *, cv: float | None, block: int = 5,
                 per_cycle: int = CANARIES_PER_BUCKET) -> None:
        self.block = block
        logs: list[list[list[float]]] = []  # bucket -> cycle -> log(latency / cycle-p99 median)
        for bucket, cycles in sample["latency_s"].items():
            if any(0 < len(c) < per_cycle for c in cycles):
                raise ValueError(f"per_cycle: the recording holds fewer than {per_cycle} "
                                 f"canaries in a cycle of bucket {bucket}")
            # The probes' canaries of one recorded cycle (a recording may hold more).
            cycles = [c[:per_cycle] for c in cycles if c]
            centre = statistics.median(math.log(max(c)) for c in cycles)
            logs.append([[math.log(x) - centre for x in c] for c in cycles])
        flat = [max(c) for s in logs for c in s]
        robust = 1.4826 * statistics.median(abs(x) for x in flat)
        # x -> x**k is monotonic: the cycle's p99 (its max) is scaled the same way.
        scale = 1.0 if cv is None else math.log(1 + cv) / robust
        self.series = [[[x * scale for x in c] for c in s] for s in logs]
        self.what = (f"recorded {sample.get('engine', '?')} canary p99s, blocks of {block}, "
                     + ("as recorded" if cv is None else f"scaled to a {cv:.0%} robust CV")
                     + f" (recorded robust CV {math.exp(robust) - 1:.0%}, lag-1 "
                     f"autocorrelation {self._lag1():.2f})")

    def _lag1(self) -> float:
        num = den = 0.0
        for cycles in self.series:
            s = [max(c) for c in cycles]
            m = statistics.fmean(s)
            num += sum((a - m) * (b - m) for a, b in zip(s, s[1:], strict=False))
            den += sum((a - m) ** 2 for a in s)
        return num / den if den else 0.0

    def stream(self, rng: random.Random) -> Iterator[list[float]]:
        """Yield one cycle's per-request factors (its p99 has median 1), forever."""
        while True:
            s = self.series[rng.randrange(len(self.series))]
            start = rng.randrange(len(s) - self.block + 1)
            for c in s[start:start + self.block]:
                yield [math.exp(x) for x in c]


@dataclass
class Outcome:
    """What one scenario produced."""

    name: str
    window: tuple[int, int] | None  # incident [start, end) in minutes, None: no incident
    should_page: bool
    minutes: int  # evaluated minutes
    pages: list[tuple[int, int | None, str]] = field(default_factory=list)  # fired, resolved, why
    false_pages: int = 0
    notifications: int = 0
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quiet_minutes: int = 0
    daily: bool = False  # a regular daily event: its false pages repeat every day
    # False: shown, not in the last line (a demonstration of what a setting prevents).
    counted: bool = True


class Sim(Replay):
    """One scenario's database, rules, policy, noise and clock."""

    def __init__(self, template: Path, workdir: Path, name: str, rules: list[Rule],
                 policy: Policy | None, noise: BlockNoise, seed: int) -> None:
        super().__init__(template, workdir, name, rules, policy, TARGET)
        self.noise = noise.stream(random.Random(seed))
        self.compiled_minutes: dict[str, int] = {}
        self.notes: list[str] = []

    def canary(self, s: Session, level: float = 1.0, instance: str = "i1",
               version: str = "m1") -> None:
        """Add one canary cycle of bucket 64: the probes' requests, latencies x level."""
        at = minute(self.i) + timedelta(seconds=2)
        run = ProbeRun(started_at=at, finished_at=at + timedelta(seconds=3), status="ok",
                       instance_id=instance, model_version=version, config_hash="c1",
                       suite="in_domain", kind="cycle")
        lat = sorted(0.1 * level * x for x in next(self.noise))
        mid = statistics.median(lat)
        run.results.append(ProbeResult(
            at=at, bucket="64", path="compiled", decoding="speculative", count=len(lat),
            errors=0, p50_s=mid, p95_s=lat[-1], p99_s=lat[-1], max_s=lat[-1],
            ttft_p95_s=lat[-1] / 4, per_token_p50_s=mid / 40, padding_waste=0.1,
            output_tokens=40, drafts=25, draft_tokens=100, accepted_tokens=80,
            latency_sketch=Sketch.of(lat).to_json(),
            ttft_sketch=Sketch.of(x / 4 for x in lat).to_json(),
            per_token_sketch=Sketch.of(x / 40 for x in lat).to_json(), samples=len(lat)))
        s.add(run)

    def traffic_compiles(self, s: Session, instance: str, recompiles: int) -> None:
        """Add real traffic's recompiles of this minute (only while compiled is on there)."""
        on = FlagStore(lambda: minute(self.i)).runtime_flags(s, instance).compiled
        if on:
            self.compiled_minutes[instance] = self.compiled_minutes.get(instance, 0) + 1
            if recompiles:
                s.add(CompileEvent(at=minute(self.i) + timedelta(seconds=30),
                                   instance_id=instance, recompiles=recompiles))

    def outcome(self, name: str, window: tuple[int, int] | None, should_page: bool,
                first_evaluated: int) -> Outcome:
        """Read back the pages, notifications and flag changes of the replay."""
        out = Outcome(name, window, should_page, self.i - first_evaluated)
        with self.sm() as s:
            alerts = s.scalars(select(Alert).where(Alert.fired_at.is_not(None),
                                                   Alert.severity == "page")
                               .order_by(Alert.fired_at)).all()
            for a in alerts:
                assert a.fired_at is not None
                fired = _offset(a.fired_at)
                resolved = _offset(a.resolved_at) if a.resolved_at is not None else None
                last = s.scalars(select(AlertTransition).where(AlertTransition.alert_id == a.id)
                                 .order_by(AlertTransition.id.desc()).limit(1)).first()
                why = (last.reason or "")[:5] if last is not None and resolved is not None else ""
                mine = window is not None and window[0] <= fired < window[1] + GRACE
                if mine:
                    out.pages.append((fired, resolved, why))
                else:
                    out.false_pages += 1
            ids = [a.id for a in alerts]
            out.notifications = len(s.scalars(select(WebhookDelivery.id).where(
                WebhookDelivery.alert_id.in_(ids))).all()) if ids else 0
            for f in s.scalars(select(FlagAudit).order_by(FlagAudit.id)).all():
                out.flags.append(f"{_offset(f.at) - (window[0] if window else 0):+d}m "
                                 f"{f.action} {f.name}/{f.scope}={f.new_value}")
        quiet = self.i - first_evaluated
        if window is not None:
            quiet -= max(0, min(self.i, window[1] + GRACE) - max(first_evaluated, window[0]))
        out.quiet_minutes = quiet
        self.engine.dispose()
        return out


def _offset(at: datetime) -> int:
    return int((at - T0).total_seconds() // 60)


def _rules(*names: str, **changes: object) -> list[Rule]:
    shipped = {r.name: r for r in load_rules()}
    return [dataclasses.replace(shipped[n], **changes) for n in names]  # type: ignore[arg-type]


def step_shift(sim: Sim, shift: float, minutes: int, post: int) -> tuple[int, int, int]:
    sim.history(HISTORY, lambda s: sim.canary(s))
    first = sim.i
    sim.step(lambda s: sim.canary(s), 10)
    start = sim.i
    sim.step(lambda s: sim.canary(s, 1 + shift), minutes)
    end = sim.i
    sim.step(lambda s: sim.canary(s), post)
    return first, start, end


def ramp(sim: Sim, top: float, up: int, hold: int, post: int) -> tuple[int, int, int]:
    sim.history(HISTORY, lambda s: sim.canary(s))
    first = sim.i
    sim.step(lambda s: sim.canary(s), 10)
    start = sim.i
    for k in range(up):
        sim.step(lambda s, k=k: sim.canary(s, 1 + top * (k + 1) / up))  # type: ignore[misc]
    sim.step(lambda s: sim.canary(s, 1 + top), hold)
    end = sim.i
    sim.step(lambda s: sim.canary(s), post)
    return first, start, end


def storm(sim: Sim, minutes: int, post: int) -> tuple[int, int, int]:
    def quiet(s: Session) -> None:
        sim.canary(s, instance="i1")
        sim.canary(s, instance="i2")

    def churn(s: Session) -> None:
        quiet(s)
        sim.traffic_compiles(s, "i1", STORM_RECOMPILES_PER_MIN)

    sim.history(HISTORY, quiet)
    first = sim.i
    sim.step(quiet, 10)
    start = sim.i
    sim.compiled_minutes.clear()
    sim.step(churn, minutes)
    end = sim.i
    sim.notes = [f"compiled on i1 for {sim.compiled_minutes.get('i1', 0)} of {minutes} "
                 f"storm minutes"]
    def calm(s: Session) -> None:
        quiet(s)
        sim.traffic_compiles(s, "i1", 0)

    sim.step(calm, post)
    return first, start, end


def dies(sim: Sim, post: int) -> tuple[int, int, int]:
    def both(s: Session) -> None:
        sim.canary(s, instance="i1")
        sim.canary(s, instance="i2")

    def churn(s: Session) -> None:
        both(s)
        sim.traffic_compiles(s, "i2", STORM_RECOMPILES_PER_MIN)

    sim.history(HISTORY, both)
    first = sim.i
    sim.step(both, 10)
    start = sim.i
    sim.step(churn, 5)  # i2 starts recompiling, then is OOM-killed and never comes back
    end = sim.i
    sim.step(lambda s: sim.canary(s, instance="i1"), post)
    return first, start, end


def rollout(sim: Sim, shift: float, minutes: int, post: int) -> tuple[int, int, int]:
    """Two instances on m1; i2 moves to m2, which is `shift` slower, for `minutes`."""
    def old(s: Session) -> None:
        sim.canary(s, instance="i1")
        sim.canary(s, instance="i2")

    def mixed(s: Session) -> None:
        sim.canary(s, instance="i1")
        sim.canary(s, 1 + shift, instance="i2", version="m2")

    sim.history(HISTORY, old)
    first = sim.i
    sim.step(old, 10)
    start = sim.i
    sim.step(mixed, minutes)
    end = sim.i
    sim.step(old, post)  # rolled back
    return first, start, end


def daily_peak(sim: Sim, days: int) -> tuple[int, int, int]:
    def level(i: int) -> float:
        return 1.25 if 14 * 60 <= i % 1440 < 16 * 60 else 1.0

    sim.history(days * 1440 + 13 * 60, lambda s: sim.canary(s, level(sim.i)))
    first = sim.i
    sim.step(lambda s: sim.canary(s, level(sim.i)), 4 * 60 + 30)
    return first, first, first


def run(args: argparse.Namespace, noise: BlockNoise) -> list[Outcome]:
    print(f"noise: {noise.what}")
    p99 = _rules("p99_latency_regression")
    compile_rules = _rules("recompiles_per_hour", "compile_failures")
    policy = load_policy()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template = work / "template.db"
        migrate.upgrade(f"sqlite:///{template}")
        seed = args.seed

        def sim(name: str, rules: list[Rule], pol: Policy | None = None) -> Sim:
            nonlocal seed
            seed += 1
            return Sim(template, work, name, rules, pol, noise, seed)

        shifts = [(0.20, 15), (0.50, 5)] if args.quick else [
            (m, d) for m in (0.10, 0.20, 0.30, 0.50) for d in (5, 15, 60)]
        for mag, dur in shifts:
            name = f"step +{mag:.0%} x {dur}m"
            s = sim(name.replace(" ", "_").replace("+", "").replace("%", ""), p99)
            first, start, end = step_shift(s, mag, dur, 60)
            outcomes.append(s.outcome(name, (start, end), mag >= 0.15, first))
        ramps = [(0.50, 60, 30)] if args.quick else [(0.50, 60, 30), (0.30, 180, 30)]
        for top, up, hold in ramps:
            name = f"ramp to +{top:.0%} over {up}m"
            s = sim(f"ramp{up}", p99)
            first, start, end = ramp(s, top, up, hold, 60)
            outcomes.append(s.outcome(name, (start, end), True, first))
        for mag in (0.30,) if args.quick else (0.20, 0.50):
            name = f"rollout: m2 +{mag:.0%} on i2"
            s = sim(f"rollout{mag:.0%}".replace("%", ""), p99)
            s.config = BaselineConfig()  # the production warm-in: m2 inherits m1's baseline
            first, start, end = rollout(s, mag, 60, 60)
            o = s.outcome(name, (start, end), True, first)
            o.notes.append(_rollout_note(s, start))
            outcomes.append(o)
        s = sim("dies", compile_rules, policy)
        first, start, end = dies(s, 30)
        o = s.outcome("instance i2 dies", (start, end), True, first)
        o.notes.append("resolved as stale" if all(p[2] == "stale" for p in o.pages) and o.pages
                       else "NOT resolved as stale")
        outcomes.append(o)
        s = sim("storm", compile_rules, policy)
        minutes = 120 if args.quick else 360
        first, start, end = storm(s, minutes, 60)
        o = s.outcome(f"recompile storm {minutes // 60}h on i1", (start, end), True, first)
        o.notes += s.notes
        outcomes.append(o)
        if not args.quick:
            seasonal = _rules("p99_latency_regression", seasonality="hour_of_week",
                              baseline_window_s=14 * 86400.0)
            for name, rules, days in (
                    ("daily peak +25% (7-day baseline)", p99, 7),
                    # 14 days: each hour of the week seen twice, its own baseline in force;
                    # 7 and 2 days: seen once, so the hour of the day stands in for it.
                    ("daily peak +25% (hour_of_week, 14d)", seasonal, 14),
                    ("daily peak +25% (hour_of_week, 7d)", seasonal, 7),
                    ("daily peak +25% (hour_of_week, 2d)", seasonal, 2)):
                s = sim(name.split("(")[-1].strip(")").replace(" ", "").replace(",", "_"),
                        rules)
                first, _, _ = daily_peak(s, days)
                o = s.outcome(name, None, False, first)
                o.daily = True
                # Without seasonality a +25% peak is a +25% change by the rule's own
                # definition: shown, not counted; a service with a daily peak sets
                # seasonality on its rules.
                o.counted = "hour_of_week" in name
                outcomes.append(o)
        s = sim("quiet", p99)
        s.history(HISTORY, lambda x: s.canary(x))
        first = s.i
        s.step(lambda x: s.canary(x), 3 * 60 if args.quick else 6 * 60)
        outcomes.append(s.outcome("quiet", None, False, first))
    return outcomes


def _rollout_note(sim: Sim, start: int) -> str:
    """Say which alerts fired, with their severity and minutes after `start`."""
    with sim.sm() as s:
        fired = s.scalars(select(Alert).where(Alert.fired_at.is_not(None))
                          .order_by(Alert.fired_at)).all()
        return "; ".join(f"{a.rule} ({a.severity}) +{_offset(a.fired_at) - start}m"
                         for a in fired if a.fired_at is not None) or "nothing fired"


def report(outcomes: list[Outcome]) -> tuple[int, float]:
    """Print the table; return (max pages per incident, false pages per 30 days)."""
    print(f"{'scenario':<36} {'pages':>5} {'notif':>5} {'delay':>6} {'resolve':>8}  notes")
    for o in outcomes:
        delay = resolve = "-"
        if o.window is not None and o.pages:
            delay = f"{o.pages[0][0] - o.window[0]}m"
            ends = [r for _, r, _ in o.pages]
            resolve = "open" if None in ends else f"{max(e for e in ends if e is not None) - o.window[1]}m"
        elif o.should_page:
            delay = "missed"
        notes = list(o.notes)
        if o.false_pages:
            notes.append(f"{o.false_pages} false page(s)"
                         + ("" if o.counted else " (not counted: no seasonality)"))
        print(f"{o.name:<36} {len(o.pages):>5} {o.notifications:>5} {delay:>6} {resolve:>8}  "
              + "; ".join(notes))
        for line in o.flags[:12]:
            print(f"{'':<38}flag {line}")
        if len(o.flags) > 12:
            print(f"{'':<38}... {len(o.flags) - 12} more flag changes")
    incidents = [len(o.pages) for o in outcomes if o.window is not None and o.should_page]
    quiet = sum(o.quiet_minutes for o in outcomes if not o.daily and o.counted)
    false = sum(o.false_pages for o in outcomes if not o.daily and o.counted)
    per_30 = false * MINUTES_30_DAYS / quiet if quiet else 0.0
    # A daily event's pages repeat once a day, every day.
    per_30 += sum(o.false_pages * 30 for o in outcomes if o.daily and o.counted)
    return max(incidents, default=0), per_30


def daily_seeds(args: argparse.Namespace, noise: BlockNoise) -> int:
    """Replay the 14-day hour-of-week daily peak for `args.daily_seeds` seeds; return how
    many of them paged falsely (a seasonal baseline's rare false page shows only over seeds)."""
    print(f"noise: {noise.what}")
    seasonal = _rules("p99_latency_regression", seasonality="hour_of_week",
                      baseline_window_s=14 * 86400.0)
    paged = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template = work / "template.db"
        migrate.upgrade(f"sqlite:///{template}")
        for seed in range(args.seed, args.seed + args.daily_seeds):
            s = Sim(template, work, f"daily{seed}", seasonal, None, noise, seed)
            first, _, _ = daily_peak(s, 14)
            o = s.outcome("daily peak", None, False, first)
            print(f"seed {seed}: {o.false_pages} false page(s)", flush=True)
            paged += o.false_pages > 0
    return paged


def service(args: argparse.Namespace, noise: BlockNoise) -> None:
    """Run the whole-service scenarios and print their last line."""
    from bench.service_incidents import run_service, summary

    print(f"noise: {noise.what}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template = work / "template.db"
        migrate.upgrade(f"sqlite:///{template}")
        outcomes = run_service(template, work, noise.stream, args.seed, args.quick,
                               ab_on_slowdown=args.ab_on_slowdown)
    print(summary(outcomes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true",
                        help="keep the recorded noise level (a shared 2-core machine)")
    parser.add_argument("--quick", action="store_true", help="a few scenarios (smoke test)")
    parser.add_argument("--daily-seeds", type=int, default=0, metavar="N",
                        help="only the 14-day hour-of-week daily peak, for N seeds from --seed")
    parser.add_argument("--canaries", type=int, default=CANARIES_PER_BUCKET, metavar="N",
                        help="canaries per cycle (probes.canaries_per_bucket; the recording "
                        "holds 10)")
    parser.add_argument("--noise", type=Path, default=NOISE_FILE, metavar="FILE",
                        help="recorded canary cycles to resample (default "
                        f"{NOISE_FILE.name}; also canary_noise_quiet.json)")
    parser.add_argument("--service", action="store_true",
                        help="whole-service scenarios: every shipped rule, pages per incident")
    parser.add_argument("--scaled", action="store_true",
                        help="with --service: noise scaled to a 10%% robust CV")
    parser.add_argument("--ab-on-slowdown", type=float, default=ProbeSettings().ab_on_slowdown,
                        metavar="SHARE", help="with --service: probes.ab_on_slowdown, the "
                        "A/B arms on demand after a slow cycle (default: shipped; 0: drawn only)")
    args = parser.parse_args()
    if args.canaries < 1:
        parser.error(f"--canaries: must be >= 1, got {args.canaries}")
    if not args.noise.is_file():
        parser.error(f"--noise: no such file: {args.noise}")
    try:
        noise = BlockNoise(json.loads(args.noise.read_text()), cv=None if args.raw else 0.10,
                           per_cycle=args.canaries)
    except (ValueError, KeyError) as e:  # a recording too small, or not one
        parser.error(f"--noise: {args.noise}: {e}")
    t = time.perf_counter()
    if args.service:
        service(args, noise if args.scaled else BlockNoise(
            json.loads(args.noise.read_text()), cv=None, per_cycle=args.canaries))
        print(f"({time.perf_counter() - t:.0f} s)")
        return
    if args.daily_seeds > 0:
        paged = daily_seeds(args, noise)
        print(f"daily peak (hour_of_week, 14 days): false pages in {paged} of "
              f"{args.daily_seeds} seeds ({time.perf_counter() - t:.0f} s)")
        return
    outcomes = run(args, noise)
    worst, per_30 = report(outcomes)
    print(f"({time.perf_counter() - t:.0f} s; a daily peak's false page counts 30 times)")
    print(f"pages per incident: max {worst}, false pages per 30 days: {per_30:.0f}")


if __name__ == "__main__":
    main()
