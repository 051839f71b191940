"""Whole-service incidents: every shipped rule and bucket at once, paged per incident.

`python -m bench.incidents --service` replays scenarios through the production
evaluator (all shipped rules and the shipped policy), the incident grouping and the
outbox, on an injected clock, with the service's incident config and settle waits
(`bench.replay`: the cause's window opens where the service's would). Each minute writes
what the service would, through its own writers, in the engine's buckets 16/32/64/128/256:

- one canary cycle per instance (`probes.reference.add_checked_cycle`, which stores it
  through `probes.sink.add_cycle`): 4 canaries per bucket, the A/B arms `eager` and
  `direct` where the production schedule says (`probes.ab_schedule.AbSchedule`, one per
  instance as in each serving process: drawn in a quarter of the cycles, `probes.ab_share`,
  and on demand in the cycle after one whose optimized canaries came out slow,
  `probes.ab_on_slowdown`, fed the simulated cycles' optimized medians); the speculative arms'
  draft and accepted tokens (acceptance per bucket, 0.74-0.82, nearly constant: the same
  prompts every cycle); the cycle's compile delta (nothing compiles in a quiet cycle);
  memory before and after (RSS about 800 MiB, a few MiB of noise, no trend); every
  arm's outputs compared with the reference path's, all exact (output agreement 1.0);
- a minute of real traffic per bucket and instance (`storage.rollups.add_rollups`: 60
  speculative requests, acceptance per bucket with noise, input lengths drawn within
  the bucket, so padding waste varies);
- now and then (about 2 a day per instance) a graph recompiled by real traffic
  (`probes.sink.add_compile`, as the prober stores what no cycle claimed).

So every shipped rule has a series except the burst rule (bursts are not written) and
the batching rules (engine.max_batch 1 writes no batch rows). Per-request latency
factors are resampled from recorded canary cycles (bench.incidents.BlockNoise, as
recorded unless scaled); the non-latency kinds draw from an rng of their own. The replay
is bench.replay.Replay: the sensitivity job runs as in the service, and every scenario
starts from a day of quiet history (what the job reads), evaluated once and estimated,
so the false-page budget's thresholds are in force as in a service that has run a day
(one database per instance layout, copied).

Scenarios: a host-wide slowdown 2x for 6 minutes; a milder +30% for 10 minutes; one
bucket's traffic shifting domain (acceptance 0.8 -> 0.45 in bucket 32); an optimization
regressing in bucket 64 (optimized arm and traffic 1.8x, reference arms unchanged); a
new cohort regressing during a rollout (i2 on m2, 1.5x, for 30 minutes); a quiet day
(`--quick`: 2 quiet hours). None of them moves memory, compiles or output agreement: the
rules on those must stay out of every incident. Printed per scenario: its incidents'
members by rule.
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
from engine.protocol import CompileDelta, MemorySnapshot
from probes.ab_schedule import AbSchedule, optimized_medians
from probes.cycle import CycleResult, PromptPair
from probes.measure import GroupResult
from probes.quality import Compared, compare, prompt_key, summarize
from probes.reference import add_checked_cycle
from probes.settings import ProbeSettings
from probes.sink import add_compile
from probes.stats import Distribution
from storage.models import Alert, Incident, IncidentMember, WebhookDelivery
from storage.queries import sensitivity as sensitivity_queries
from storage.queries.quality import AgreementGroup
from storage.rollups import RollupDelta, RollupKey, add_rollups
from storage.sketches import Sketch, lengths_of
from vocab import AbReason

T0 = datetime(2026, 1, 5, tzinfo=UTC)
# The engine's default buckets (engine.config.DEFAULT_BUCKETS): seconds per request (p50).
BUCKETS = {"16": 0.16, "32": 0.20, "64": 0.30, "128": 0.45, "256": 0.80}
# Speculation's acceptance per bucket, canaries and traffic alike while the traffic is in
# the canaries' domain: longer inputs are drafted a little worse.
ACCEPTANCE = {"16": 0.82, "32": 0.80, "64": 0.79, "128": 0.77, "256": 0.74}
# The canaries are the same prompts every cycle (greedy decoding): their acceptance moves
# only as the engine's draft length adapts, far less than a minute of varied traffic's.
CANARY_ACCEPTANCE_SD = 0.005
TRAFFIC_ACCEPTANCE_SD = 0.01
OUTPUT_TOKENS = 40  # per request, canaries and traffic
# The engine process's resident set once warm, and how far one sample strays from it
# (allocator arenas taken and given back between two reads): no trend, nothing leaks.
RSS_BYTES = 800 * 2**20
RSS_SD_BYTES = 2 * 2**20
KV_STATIC_BYTES = 24 * 2**20
# Chance per instance and minute that real traffic recompiles one graph (a shape the
# warm-up did not cover): rare, one at a time, under the recompile rule's ceiling.
RECOMPILE_PER_MIN = 1 / 720
ARMS = {"optimized": ("compiled", "speculative"), "eager": ("eager", "speculative"),
        "direct": ("compiled", "direct")}
AB_SHARE = ProbeSettings().ab_share
AB_ON_SLOWDOWN = ProbeSettings().ab_on_slowdown
CANARIES = 4  # per bucket and arm (probes.canaries_per_bucket)
TRAFFIC_PER_MIN = 60
AUX_SEED = 7919
# Quiet minutes before a scenario: a day, the cycles the sensitivity job reads
# (alerts.sensitivity_history_s), so every series has an estimate in force.
HISTORY = round(AlertSettings().sensitivity_history_s / 60)
TARGET = WebhookTarget(name="oncall", url="http://127.0.0.1:9/hook", format="generic")
MINUTES_30_DAYS = 30 * 24 * 60
QUIET_FULL = 24 * 60  # minutes of the quiet scenario
QUIET_QUICK = 120

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
    # Incident -> minutes after the end of its last firing notification (late ones too).
    fired: dict[int, float] = field(default_factory=dict)
    late: int = 0
    early: int = 0
    quiet_minutes: int = 0
    causes: list[str] = field(default_factory=list)
    stated: str | None = None  # the cause stored on the first page's incident at the end
    # Of each false (late or early) page, its members: "rule bucket/path (threshold)".
    false_members: list[str] = field(default_factory=list)
    # The series' sensitivity estimates at the end: status (or "widened") -> how many.
    sensitivity: dict[str, int] = field(default_factory=dict)
    # The paged incidents' members at the end: rule -> alerts.
    members: dict[str, int] = field(default_factory=dict)
    # The evaluated minutes' cycles by why their arms ran ("drawn", "slowdown", "": none).
    ab: dict[str, int] = field(default_factory=dict)

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

    def open_at_end(self, incident: int) -> bool:
        """Return whether `incident` is open at the end: never resolved, or fired again
        after its last resolved notification."""
        times = self.resolved.get(incident, [])
        return not times or self.fired.get(incident, times[-1]) > times[-1]

    def resolved_after(self) -> float | None:
        """Return the minutes from the cause's end to its incidents' last resolved
        notification; None when one of them is still open (or nothing paged)."""
        times = self.resolutions()
        if not times or any(self.open_at_end(inc) for inc in times):
            return None
        return max(t[-1] for t in times.values())


class ServiceSim(Replay):
    """One scenario's database, every shipped rule, the policy, noise and clock."""

    def __init__(self, template: Path, workdir: Path, name: str,
                 noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
                 warmed_at: int | None = None,
                 ab_on_slowdown: float | None = AB_ON_SLOWDOWN) -> None:
        super().__init__(template, workdir, name, load_rules(), load_policy(), TARGET,
                         warmed_at=warmed_at)
        self.rng = random.Random(seed)
        # Each instance's serving process decides its own A/B cycles (probes.ab_schedule).
        self.ab_on_slowdown = ab_on_slowdown
        self.schedules: dict[str, AbSchedule] = {}
        self.ab: dict[str, int] = {}  # cycles by why their arms ran ("": none)
        # The non-latency kinds draw apart: changing them leaves the latency draws alone.
        self.aux = random.Random(seed + AUX_SEED)
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
        for inst, version in world.instances.items():
            schedule = self.schedules.setdefault(inst, AbSchedule(
                share=AB_SHARE, on_slowdown=self.ab_on_slowdown))
            reason = schedule.due(self.rng)
            self.ab[reason or ""] = self.ab.get(reason or "", 0) + 1
            groups = self._cycle(s, world, inst, version, at, reason)
            schedule.observe(optimized_medians(groups), ab=reason is not None)
            add_rollups(s, [(RollupKey(at, inst, bucket, "compiled", "speculative"),
                             self._traffic(world, inst, bucket))
                            for bucket in BUCKETS])
            if self.aux.random() < RECOMPILE_PER_MIN:
                # Real traffic's recompiles: stored outside any cycle, as
                # probes.prober.Prober.record_unprobed_compiles does.
                add_compile(s, _recompile(), at + timedelta(seconds=40), inst)

    def _cycle(self, s: Session, world: World, inst: str, version: str, at: datetime,
               reason: str | None) -> list[GroupResult]:
        """Add one instance's canary cycle, its output agreements, memory and compiles;
        return its groups. `reason`: why its arms run (None: they do not)."""
        ab = reason is not None
        groups: list[GroupResult] = []
        pairs: list[PromptPair] = []
        for bucket, base in BUCKETS.items():
            arms = {arm: [base * world.slow(inst, arm, bucket) * f
                          for f in self._factors((inst, arm, bucket), CANARIES)]
                    for arm in (ARMS if ab else ("optimized",))}
            rate = ACCEPTANCE[bucket] + self.aux.gauss(0, CANARY_ACCEPTANCE_SD)
            groups += [_group(bucket, arm, lat, rate) for arm, lat in arms.items()]
            # An A/B cycle's canary i runs its optimized request and arms back to back.
            pairs += [PromptPair(bucket, f"{bucket}-{i}", tuple(arms),
                                 {arm: lat[i] for arm, lat in arms.items()})
                      for i in range(CANARIES) if ab]
        started, finished = at + timedelta(seconds=2), at + timedelta(seconds=20)
        add_checked_cycle(s, CycleResult(
            suite="in_domain", instance_id=inst, started_at=started, finished_at=finished,
            status="ok", ab=ab, ab_reason=reason or "", groups=tuple(groups),
            pairs=tuple(pairs),
            memory_before=self._memory(), memory_after=self._memory(),
            compile=CompileDelta.none(), ab_compile=CompileDelta.none() if ab else None,
            model_version=version, config_hash="c1"), _agreements(groups))
        return groups

    def _memory(self) -> MemorySnapshot:
        """Return one quiet memory reading of the engine process (CPU: RSS)."""
        rss = RSS_BYTES + round(self.aux.gauss(0, RSS_SD_BYTES))
        return MemorySnapshot(device="cpu", rss_bytes=rss, kv_cache_bytes=KV_STATIC_BYTES,
                              kv_static_bytes=KV_STATIC_BYTES)

    def _traffic(self, world: World, inst: str, bucket: str) -> RollupDelta:
        """Return one bucket's minute of real traffic on one instance."""
        lat = [BUCKETS[bucket] * world.slow(inst, "optimized", bucket) * f
               for f in self._factors((inst, "traffic", bucket), TRAFFIC_PER_MIN)]
        acc = world.acceptance.get(bucket, ACCEPTANCE[bucket]) \
            + self.rng.gauss(0, TRAFFIC_ACCEPTANCE_SD)
        lo, hi = _edges(bucket)
        inputs = [self.aux.randint(lo + 1, hi) for _ in lat]
        return _traffic(lat, acc, inputs, int(bucket))

    def run(self, worlds: list[tuple[int, World]], *, history: int = HISTORY) -> int:
        """Write `history` quiet minutes (unless the template holds them), then evaluate
        each minute of `worlds`; return the first evaluated minute."""
        quiet = World(instances=worlds[0][1].instances)
        self.history(history - self.i, lambda s: self.write(s, quiet))
        if self.job_at is None:
            self.evaluate()  # the service's state at the end of its history
        first = self.i
        self.ab = {}  # the evaluated minutes' only
        for count, world in worlds:
            self.step(lambda s, w=world: self.write(s, w), count)  # type: ignore[misc]
        return first

    def outcome(self, name: str, window: tuple[int, int] | None, expected: str | None,
                first: int) -> ServiceOutcome:
        """Read back the incidents' firing notifications."""
        out = ServiceOutcome(name, window, expected, ab=dict(self.ab))
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
            out.fired[inc["id"]] = (r.created_at - end).total_seconds() / 60
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
                out.members = _member_rules(s, {inc for _, inc, _ in out.pages})
        out.quiet_minutes = (self.i - first) - ((window[1] - window[0]) if window else 0)
        with self.sm() as s:
            for est in sensitivity_queries.by_key(s).values():
                kind = "widened" if est.threshold > est.configured_threshold else est.status
                out.sensitivity[kind] = out.sensitivity.get(kind, 0) + 1
        self.engine.dispose()
        return out


def _member_rules(s: Session, incidents: set[int]) -> dict[str, int]:
    """Return rule -> how many of its alerts joined `incidents`."""
    rules = s.scalars(select(Alert.rule).join(IncidentMember, IncidentMember.alert_id == Alert.id)
                      .where(IncidentMember.incident_id.in_(incidents))).all()
    out: dict[str, int] = {}
    for rule in rules:
        out[rule] = out.get(rule, 0) + 1
    return dict(sorted(out.items()))


def _member(alert: Mapping[str, Any]) -> str:
    """Return "rule bucket/path/decoding (threshold in force)" of a notified member."""
    labels = alert.get("labels") or {}
    where = "/".join(labels[k] for k in ("instance", "bucket", "path", "decoding")
                     if k in labels)
    threshold = alert.get("threshold")
    return f"{alert.get('rule')} {where or 'all'}" + (
        f" ({threshold:+.0%})" if isinstance(threshold, int | float) else "")


def _group(bucket: str, arm: str, lat: list[float],
           acceptance: float | None = None) -> GroupResult:
    """Return one arm's canaries of one bucket as the cycle measures them (acceptance:
    the bucket's quiet one unless given)."""
    if acceptance is None:
        acceptance = ACCEPTANCE.get(bucket, ACCEPTANCE["32"])
    path, decoding = ARMS[arm]
    spec = decoding == "speculative"
    n = len(lat)
    per_token = [x / OUTPUT_TOKENS for x in lat]
    return GroupResult(
        bucket=bucket, path=path, decoding=decoding, variant=arm, requests=n,
        latency=Distribution.of(lat), ttft=Distribution.of([x / 4 for x in lat]),
        per_token=Distribution.of(per_token), queue_wait=Distribution.of([0.0] * n),
        input_tokens=Distribution.of([float(bucket) * 0.8] * n),
        padded_length=int(bucket), padding_waste=0.2, output_tokens=OUTPUT_TOKENS * n,
        drafts=25 * n if spec else 0, draft_tokens=100 * n if spec else 0,
        accepted_tokens=round(100 * n * _clamp(acceptance)) if spec else 0,
        latency_sketch=Sketch.of(lat).to_json(),
        ttft_sketch=Sketch.of([x / 4 for x in lat]).to_json(),
        per_token_sketch=Sketch.of(per_token).to_json())


def _agreements(groups: list[GroupResult]) -> tuple[AgreementGroup, ...]:
    """Return every canary output compared with its reference: all exact.

    The optimizations the cycles run (compiled, speculative, float32) leave greedy
    outputs unchanged, so every arm gives the reference path's tokens.
    """
    tokens = list(range(OUTPUT_TOKENS))
    return summarize(
        Compared(prompt_key(f"{g.bucket}-{i}", OUTPUT_TOKENS), g.bucket, g.path, g.decoding,
                 g.variant, compare(tokens, tokens))
        for g in groups for i in range(g.requests))


def _recompile() -> CompileDelta:
    """Return one graph recompiled by a shape real traffic brought."""
    return CompileDelta(graphs=1, recompiles=1, recompile_reasons={"size mismatch": 1},
                        graph_breaks=0, graph_break_reasons={}, compile_seconds=2.5,
                        recompile_limit_hits=0, compile_failures=0)


def _edges(bucket: str) -> tuple[int, int]:
    """Return the input lengths (lo, hi] a bucket takes (engine.buckets)."""
    edges = [int(b) for b in BUCKETS]
    i = edges.index(int(bucket))
    return (edges[i - 1] if i else 1), edges[i]


def _clamp(rate: float) -> float:
    """Return `rate` within [0, 1]."""
    return max(0.0, min(1.0, rate))


def _traffic(lat: list[float], acc: float, inputs: list[int], padded: int) -> RollupDelta:
    """Return a minute of speculative requests as the rollup writer adds it."""
    n = len(lat)
    drafted = n * 100
    ttft = [x / 4 for x in lat]
    return RollupDelta(
        requests=n, latency_sum_s=sum(lat), ttft_sum_s=sum(ttft),
        input_tokens_sum=sum(inputs), padded_tokens_sum=padded * n,
        output_tokens_sum=OUTPUT_TOKENS * n, drafts=drafted // 4, draft_tokens=drafted,
        accepted_tokens=round(drafted * _clamp(acc)),
        latency_sketch=Sketch.of(lat).to_json(), ttft_sketch=Sketch.of(ttft).to_json(),
        per_token_sketch=Sketch.of([x / OUTPUT_TOKENS for x in lat]).to_json(),
        input_lens=lengths_of(inputs), output_lens=lengths_of([OUTPUT_TOKENS] * n))


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
    # A full run's quiet day after the day of history: false pages per 30 days rest on
    # every hour of a day (each hour's chunk, the job's re-estimates), not on a few.
    out.append(("quiet", [(QUIET_QUICK if quick else QUIET_FULL, calm)], -1, None))
    return out


def warmed(template: Path, workdir: Path, instances: Mapping[str, str],
           noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
           history: int = HISTORY, ab_on_slowdown: float | None = AB_ON_SLOWDOWN) -> Path:
    """Return a database holding `history` quiet minutes of `instances`, evaluated once at
    their end and the sensitivity job run (the scenarios of one layout start from a copy)."""
    name = "warm-" + "-".join(f"{i}{v}" for i, v in sorted(instances.items()))
    sim = ServiceSim(template, workdir, name, noise, seed, ab_on_slowdown=ab_on_slowdown)
    sim.run([(0, World(instances=instances))], history=history)
    sim.engine.dispose()
    return sim.path


def run_service(template: Path, workdir: Path,
                noise: Callable[[random.Random], Iterator[list[float]]], seed: int,
                quick: bool, ab_on_slowdown: float | None = AB_ON_SLOWDOWN
                ) -> list[ServiceOutcome]:
    """Replay every scenario; return their outcomes (A/B arms on demand after a slow
    cycle as `probes.ab_on_slowdown` = `ab_on_slowdown`; 0 or None: drawn only)."""
    outcomes = []
    warm: dict[tuple[tuple[str, str], ...], Path] = {}
    for k, (name, worlds, start, expected) in enumerate(scenarios(quick)):
        layout = tuple(sorted(worlds[0][1].instances.items()))
        if layout not in warm:
            warm[layout] = warmed(template, workdir, dict(layout), noise,
                                  seed - 1 - len(warm), ab_on_slowdown=ab_on_slowdown)
        sim = ServiceSim(warm[layout], workdir, f"service{k}", noise, seed + k,
                         warmed_at=HISTORY, ab_on_slowdown=ab_on_slowdown)
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
                f"#{inc} " + ", ".join([*(f"+{t:.1f}m after the end" for t in times),
                                        *(["open at the end"] if o.open_at_end(inc) else [])])
                for inc, times in o.resolutions().items()), flush=True)
        if o.members:
            print(f"{'':<44} members: " + ", ".join(
                f"{rule} {n}" for rule, n in o.members.items()), flush=True)
        if o.false_members:
            print(f"{'':<44} false pages' members: " + "; ".join(o.false_members))
        print(f"{'':<44} sensitivity of its series: " + ", ".join(
            f"{n} {kind}" for kind, n in sorted(o.sensitivity.items())), flush=True)
        print(f"{'':<44} A/B cycles: {o.ab.get(AbReason.DRAWN, 0)} drawn, "
              f"{o.ab.get(AbReason.SLOWDOWN, 0)} on demand, of {sum(o.ab.values())}", flush=True)
    return outcomes


def ab_line(outcomes: list[ServiceOutcome]) -> str:
    """Return the share of cycles that ran the arms, drawn and on demand (all scenarios;
    the quiet ones alone: what slow-cycle demand costs without an incident)."""
    def shares(os: list[ServiceOutcome]) -> str:
        total = sum(sum(o.ab.values()) for o in os)
        drawn = sum(o.ab.get(AbReason.DRAWN, 0) for o in os)
        demand = sum(o.ab.get(AbReason.SLOWDOWN, 0) for o in os)
        return (f"{drawn / total:.0%} drawn, {demand / total:.0%} on demand of {total}"
                if total else "none")
    quiet = [o for o in outcomes if o.window is None]
    return f"A/B cycles: {shares(outcomes)}" + (
        f" (quiet scenario: {shares(quiet)})" if quiet else "")


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
            + f"{ab_line(outcomes)}\n"
            + f"first page stated the right cause: {first} of {len(incidents)}\n"
            + (f"resolved notifications per incident: {min(counts)}-{max(counts)}, "
               f"after the cause ended: max "
               + (f"{slowest:.0f} min" if slowest is not None else "-")
               + (f", {still} still open at the end" if still else "") + "\n"
               if counts else "")
            + f"pages per incident: max {worst} (all rules), cause right: {right} of "
              f"{len(incidents)}, false pages per 30 days: {per_30:.0f}")
