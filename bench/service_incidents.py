"""Whole-service incidents: every shipped rule and bucket at once, paged per incident.

`python -m bench.incidents --service` replays scenarios through the production
evaluator (all shipped rules and the shipped policy), the incident grouping and the
outbox, on an injected clock. Each minute writes what the service would: one canary
cycle per instance through `probes.sink.add_cycle` (4 canaries per bucket; the A/B arms
`eager` and `direct` in a quarter of the cycles, as `probes.ab_share` does) and a minute
of real traffic per bucket (60 requests, speculative, acceptance about 0.8). Per-request
latency factors are resampled from recorded canary cycles (bench.incidents.BlockNoise,
as recorded unless scaled). The replay is bench.replay.Replay: the sensitivity job
runs as in the service, and every scenario starts from a day of quiet history (what the
job reads), evaluated once and estimated, so the false-page budget's thresholds are in
force as in a service that has run a day (one database per instance layout, copied).

Scenarios: a host-wide slowdown 2x for 6 minutes; a milder +30% for 10 minutes; one
bucket's traffic shifting domain (acceptance 0.8 -> 0.45 in bucket 32); an optimization
regressing in bucket 64 (optimized arm and traffic 1.8x, reference arms unchanged); a
new cohort regressing during a rollout (i2 on m2, 1.5x, for 30 minutes); a quiet stretch.
A page is a firing notification of an incident (any severity, reopenings included) at
the generic target; it is the incident's while the scenario's cause lasts, and late
(counted with the false pages) once it ended. The cause is right when the incident
states the expected one (as the API and the resolved notification show it: a cause not
measurable at the first page, the A/B arms not having run yet, is measured again while
the incident is open); how many first pages already stated it is printed above. Each
scenario's incidents also count their resolved notifications at the target and the minutes
from the cause's end to the last of them (an incident still open at the end: "open"). The
last line, after each false page's members (rule, scope, threshold in force) tallied by
rule and the resolutions:

    pages per incident: max N (all rules), cause right: C of S, false pages per 30 days: M
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from alerts.policy import load_policy
from alerts.rule_file import load_rules
from alerts.settings import AlertSettings
from alerts.webhooks import WebhookTarget
from bench.replay import Replay
from probes.cycle import CycleResult, PromptPair
from probes.measure import GroupResult
from probes.sink import add_cycle
from probes.stats import Distribution
from storage.models import Incident, TrafficRollup, WebhookDelivery
from storage.queries import sensitivity as sensitivity_queries
from storage.sketches import Sketch

T0 = datetime(2026, 1, 5, tzinfo=UTC)
BUCKETS = {"32": 0.20, "64": 0.30, "128": 0.45, "256": 0.80}  # seconds per request (p50)
ARMS = {"optimized": ("compiled", "speculative"), "eager": ("eager", "speculative"),
        "direct": ("compiled", "direct")}
AB_SHARE = 0.25
TRAFFIC_PER_MIN = 60
# Quiet minutes before a scenario: a day, the cycles the sensitivity job reads
# (alerts.sensitivity_history_s), so every series has an estimate in force.
HISTORY = round(AlertSettings().sensitivity_history_s / 60)
TARGET = WebhookTarget(name="oncall", url="http://127.0.0.1:9/hook", format="generic")
MINUTES_30_DAYS = 30 * 24 * 60

# A minute's conditions: (instance, arm, bucket) -> latency factor; bucket -> acceptance.
Slow = Callable[[str, str, str], float]


def minute(i: int) -> datetime:
    return T0 + timedelta(minutes=i)


@dataclass
class World:
    """What the service sees in one minute."""

    slow: Slow = lambda inst, arm, bucket: 1.0  # noqa: E731 - a default condition
    acceptance: Mapping[str, float] = field(default_factory=dict)
    instances: Mapping[str, str] = field(default_factory=lambda: {"i1": "m1"})


@dataclass
class ServiceOutcome:
    """What one scenario produced."""

    name: str
    window: tuple[int, int] | None
    expected: str | None
    pages: list[tuple[int, int, str]] = field(default_factory=list)  # minute, incident, cause
    # Resolved notifications: incident -> minutes after the cause's end (the scenario's end
    # when it has no cause) at which each was queued.
    resolved: dict[int, list[float]] = field(default_factory=dict)
    late: int = 0
    early: int = 0
    quiet_minutes: int = 0
    causes: list[str] = field(default_factory=list)
    stated: str | None = None  # the cause stored on the first page's incident at the end
    # Of each false (late or early) page, its members: "rule bucket/path (threshold)".
    false_members: list[str] = field(default_factory=list)
    # The series' sensitivity estimates at the end: status (or "widened") -> how many.
    sensitivity: dict[str, int] = field(default_factory=dict)

    @property
    def cause_right(self) -> bool:
        """Return whether the incident states the expected cause (as the API shows it)."""
        return self.stated is not None and self.stated == self.expected

    @property
    def first_page_right(self) -> bool:
        """Return whether the first page already stated the expected cause."""
        return bool(self.pages) and self.pages[0][2] == self.expected

    def resolutions(self) -> dict[int, list[float]]:
        """Return each paged incident's resolved notifications (minutes after the end)."""
        return {inc: self.resolved.get(inc, []) for inc in sorted({i for _, i, _ in self.pages})}

    def resolved_after(self) -> float | None:
        """Return the minutes from the cause's end to its incidents' last resolved
        notification; None when one of them is still open (or nothing paged)."""
        times = self.resolutions()
        if not times or any(not t for t in times.values()):
            return None
        return max(t[-1] for t in times.values())


class ServiceSim(Replay):
    """One scenario's database, every shipped rule, the policy, noise and clock."""

    def __init__(self, template: Path, workdir: Path, name: str,
                 noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
                 warmed_at: int | None = None) -> None:
        super().__init__(template, workdir, name, load_rules(), load_policy(), TARGET,
                         warmed_at=warmed_at)
        self.rng = random.Random(seed)
        self.streams: dict[tuple[str, str, str], Iterator[list[float]]] = {}
        self.noise = noise

    def _factors(self, key: tuple[str, str, str], n: int) -> list[float]:
        if key not in self.streams:
            self.streams[key] = self.noise(random.Random(self.rng.random()))
        out: list[float] = []
        while len(out) < n:
            out += next(self.streams[key])
        return out[:n]

    def write(self, s: Session, world: World) -> None:
        """Write one minute: a canary cycle per instance and a minute of real traffic."""
        at = minute(self.i)
        ab = self.rng.random() < AB_SHARE
        for inst, version in world.instances.items():
            groups, pairs = [], []
            for bucket, base in BUCKETS.items():
                arms = {arm: [base * world.slow(inst, arm, bucket) * f
                              for f in self._factors((inst, arm, bucket), 4)]
                        for arm in (ARMS if ab else ("optimized",))}
                groups += [_group(bucket, arm, lat) for arm, lat in arms.items()]
                # An A/B cycle's canary i runs its optimized request and arms back to back.
                pairs += [PromptPair(bucket, f"{bucket}-{i}", tuple(arms),
                                     {arm: lat[i] for arm, lat in arms.items()})
                          for i in range(4) if ab]
            add_cycle(s, CycleResult(
                suite="in_domain", instance_id=inst, started_at=at + timedelta(seconds=2),
                finished_at=at + timedelta(seconds=20), status="ok", ab=ab,
                groups=tuple(groups), pairs=tuple(pairs), model_version=version,
                config_hash="c1"))
            for bucket, base in BUCKETS.items():
                lat = [base * world.slow(inst, "optimized", bucket) * f
                       for f in self._factors((inst, "traffic", bucket), TRAFFIC_PER_MIN)]
                acc = world.acceptance.get(bucket, 0.8) + self.rng.gauss(0, 0.01)
                s.add(_traffic(at, inst, bucket, lat, acc))

    def run(self, worlds: list[tuple[int, World]], *, history: int = HISTORY) -> int:
        """Write `history` quiet minutes (unless the template holds them), then evaluate
        each minute of `worlds`; return the first evaluated minute."""
        quiet = World(instances=worlds[0][1].instances)
        self.history(history - self.i, lambda s: self.write(s, quiet))
        if self.job_at is None:
            self.evaluate()  # the service's state at the end of its history
        first = self.i
        for count, world in worlds:
            self.step(lambda s, w=world: self.write(s, w), count)  # type: ignore[misc]
        return first

    def outcome(self, name: str, window: tuple[int, int] | None, expected: str | None,
                first: int) -> ServiceOutcome:
        """Read back the incidents' firing notifications."""
        out = ServiceOutcome(name, window, expected)
        with self.sm() as s:
            rows = s.scalars(select(WebhookDelivery).order_by(WebhookDelivery.id)).all()
        end = minute(window[1] if window is not None else self.i)
        for r in rows:
            p = r.payload
            inc = p.get("incident") or {}
            if p.get("kind") == "incident" and inc.get("notification") == "resolved":
                out.resolved.setdefault(inc["id"], []).append(
                    (r.created_at - end).total_seconds() / 60)
            if p.get("kind") != "incident" or inc.get("notification") != "firing":
                continue
            at = int((r.created_at - T0).total_seconds() // 60)
            if window is not None and window[0] <= at < window[1]:
                out.pages.append((at, inc["id"], inc["cause"]))
            else:
                if window is not None and at >= window[1]:
                    out.late += 1
                else:
                    out.early += 1
                out.false_members += [_member(m) for m in inc.get("members") or ()]
            out.causes.append(f"+{at - (window[0] if window else first)}m #{inc['id']} "
                              f"{inc['probable_cause']}")
        if out.pages:
            with self.sm() as s:
                row = s.get(Incident, out.pages[0][1])
                out.stated = row.cause if row is not None else None
        out.quiet_minutes = (self.i - first) - ((window[1] - window[0]) if window else 0)
        with self.sm() as s:
            for est in sensitivity_queries.by_key(s).values():
                kind = "widened" if est.threshold > est.configured_threshold else est.status
                out.sensitivity[kind] = out.sensitivity.get(kind, 0) + 1
        self.engine.dispose()
        return out


def _member(alert: Mapping[str, Any]) -> str:
    """Return "rule bucket/path/decoding (threshold in force)" of a notified member."""
    labels = alert.get("labels") or {}
    where = "/".join(labels[k] for k in ("instance", "bucket", "path", "decoding")
                     if k in labels)
    threshold = alert.get("threshold")
    return f"{alert.get('rule')} {where or 'all'}" + (
        f" ({threshold:+.0%})" if isinstance(threshold, int | float) else "")


def _group(bucket: str, arm: str, lat: list[float]) -> GroupResult:
    path, decoding = ARMS[arm]
    per_token = [x / 40 for x in lat]
    return GroupResult(
        bucket=bucket, path=path, decoding=decoding, variant=arm, requests=len(lat),
        latency=Distribution.of(lat), ttft=Distribution.of([x / 4 for x in lat]),
        per_token=Distribution.of(per_token), queue_wait=Distribution.of([0.0] * len(lat)),
        input_tokens=Distribution.of([float(bucket) * 0.8] * len(lat)),
        padded_length=int(bucket), padding_waste=0.2, output_tokens=40 * len(lat),
        drafts=25 * len(lat) if decoding == "speculative" else 0,
        draft_tokens=100 * len(lat) if decoding == "speculative" else 0,
        accepted_tokens=80 * len(lat) if decoding == "speculative" else 0,
        latency_sketch=Sketch.of(lat).to_json(),
        ttft_sketch=Sketch.of([x / 4 for x in lat]).to_json(),
        per_token_sketch=Sketch.of(per_token).to_json())


def _traffic(at: datetime, inst: str, bucket: str, lat: list[float], acc: float) -> TrafficRollup:
    n = len(lat)
    drafted = n * 100
    return TrafficRollup(
        minute=at, instance_id=inst, bucket=bucket, path="compiled", decoding="speculative",
        requests=n, latency_sum_s=sum(lat), ttft_sum_s=sum(lat) / 4,
        input_tokens_sum=int(int(bucket) * 0.8) * n, padded_tokens_sum=int(bucket) * n,
        output_tokens_sum=40 * n, drafts=drafted // 4, draft_tokens=drafted,
        accepted_tokens=int(round(drafted * max(0.0, min(1.0, acc)))),
        latency_sketch=Sketch.of(lat).to_json(),
        ttft_sketch=Sketch.of([x / 4 for x in lat]).to_json(),
        per_token_sketch=Sketch.of([x / 40 for x in lat]).to_json())


def scenarios(quick: bool) -> list[tuple[str, list[tuple[int, World]], int, str | None]]:
    """Return (name, minutes of worlds, the cause's start offset, expected cause)."""
    calm = World()

    def everywhere(f: float) -> World:
        return World(slow=lambda inst, arm, b: f)

    def opt64(inst: str, arm: str, bucket: str) -> float:
        return 1.8 if arm == "optimized" and bucket == "64" else 1.0

    two = {"i1": "m1", "i2": "m1"}
    rolled = {"i1": "m1", "i2": "m2"}
    post = 30 if quick else 60
    out: list[tuple[str, list[tuple[int, World]], int, str | None]] = [
        ("host-wide 2x for 6m", [(10, calm), (6, everywhere(2.0)), (post, calm)], 10,
         "host_or_load"),
        ("host-wide +30% for 10m", [(10, calm), (10, everywhere(1.3)), (post, calm)], 10,
         "host_or_load"),
        ("bucket 32 traffic shifts domain (20m)",
         [(10, calm), (20, World(acceptance={"32": 0.45})), (post, calm)], 10, "one_bucket"),
        ("optimization regresses in bucket 64 (20m)",
         [(10, calm), (20, World(slow=opt64)), (post, calm)], 10, "optimization"),
        ("rollout: i2 on m2 1.5x (30m)",
         [(10, World(instances=two)),
          (30, World(instances=rolled,
                     slow=lambda inst, arm, b: 1.5 if inst == "i2" else 1.0)),
          (post, World(instances=two))], 10, "one_instance"),
    ]
    out.append(("quiet", [(120 if quick else 360, calm)], -1, None))
    return out


def warmed(template: Path, workdir: Path, instances: Mapping[str, str],
           noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
           history: int = HISTORY) -> Path:
    """Return a database holding `history` quiet minutes of `instances`, evaluated once at
    their end and the sensitivity job run (the scenarios of one layout start from a copy)."""
    name = "warm-" + "-".join(f"{i}{v}" for i, v in sorted(instances.items()))
    sim = ServiceSim(template, workdir, name, noise, seed)
    sim.run([(0, World(instances=instances))], history=history)
    sim.engine.dispose()
    return sim.path


def run_service(template: Path, workdir: Path,
                noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
                quick: bool) -> list[ServiceOutcome]:
    """Replay every scenario; return their outcomes."""
    outcomes = []
    warm: dict[tuple[tuple[str, str], ...], Path] = {}
    for k, (name, worlds, start, expected) in enumerate(scenarios(quick)):
        layout = tuple(sorted(worlds[0][1].instances.items()))
        if layout not in warm:
            warm[layout] = warmed(template, workdir, dict(layout), noise, seed - 1 - len(warm))
        sim = ServiceSim(warm[layout], workdir, f"service{k}", noise, seed + k,
                         warmed_at=HISTORY)
        first = sim.run(worlds)
        window = None
        if start >= 0:
            begin = first + start
            window = (begin, begin + worlds[1][0])
        o = sim.outcome(name, window, expected, first)
        outcomes.append(o)
        print(f"{name:<44} pages {len(o.pages)}  late {o.late}  early {o.early}  "
              f"stated {o.stated or '-'}  pages: " + ("; ".join(o.causes) or "none"),
              flush=True)
        if o.pages:
            print(f"{'':<44} resolved: " + "; ".join(
                f"#{inc} " + (", ".join(f"+{t:.1f}m after the end" for t in times)
                              if times else "open at the end")
                for inc, times in o.resolutions().items()), flush=True)
        if o.false_members:
            print(f"{'':<44} false pages' members: " + "; ".join(o.false_members))
        print(f"{'':<44} sensitivity of its series: " + ", ".join(
            f"{n} {kind}" for kind, n in sorted(o.sensitivity.items())), flush=True)
    return outcomes


def summary(outcomes: list[ServiceOutcome]) -> str:
    """Return the last line: pages per incident, causes right, false pages per 30 days."""
    incidents = [o for o in outcomes if o.window is not None]
    worst = max((len(o.pages) for o in incidents), default=0)
    right = sum(o.cause_right for o in incidents)
    first = sum(o.first_page_right for o in incidents)
    false = sum(o.late + o.early for o in outcomes)
    quiet = sum(o.quiet_minutes for o in outcomes)
    per_30 = false * MINUTES_30_DAYS / quiet if quiet else 0.0
    missed = [o.name for o in incidents if not o.pages]
    counts = [len(t) for o in incidents for t in o.resolutions().values()]
    after = [o.resolved_after() for o in incidents if o.pages]
    still = sum(a is None for a in after)
    slowest = max((a for a in after if a is not None), default=None)
    by_rule: dict[str, int] = {}
    for o in outcomes:
        for m in o.false_members:
            by_rule[m.split()[0]] = by_rule.get(m.split()[0], 0) + 1
    return ((f"missed: {', '.join(missed)}\n" if missed else "")
            + (("false pages' members by rule: " + ", ".join(
                f"{r} {n}" for r, n in sorted(by_rule.items())) + "\n") if by_rule else "")
            + f"first page stated the right cause: {first} of {len(incidents)}\n"
            + (f"resolved notifications per incident: {min(counts)}-{max(counts)}, "
               f"after the cause ended: max "
               + (f"{slowest:.0f} min" if slowest is not None else "-")
               + (f", {still} still open at the end" if still else "") + "\n"
               if counts else "")
            + f"pages per incident: max {worst} (all rules), cause right: {right} of "
              f"{len(incidents)}, false pages per 30 days: {per_30:.0f}")
