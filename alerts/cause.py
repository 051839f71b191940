"""An incident's probable cause, measured from the same-cycle A/B arms and the instances.

The A/B canary cycles run each prompt's optimized request and its reference arms (`eager`,
`direct`) back to back: when they slow down alike, the machine (or its load) got slower;
when only the optimized arm does, an optimization regressed. The optimized arm runs every
cycle: its change is the median over buckets of (median p50 during the incident / median
p50 in the hour before it, leaving out the minutes at the change's edge). A reference
arm's change is read against it through the measured speedup, the one definition of
storage.queries.speedups (reference / optimized latency paired per prompt within a cycle,
median over pairs): per bucket, the optimized arm's change times the change of that
speedup between the hour before and the incident, so what a cycle's conditions do to
both arms of a pair cancels out. The instances are compared on their optimized arm.

In order, the first that holds is the cause:
    one_instance   several instances report and only some slowed (members name them)
    host_or_load   the optimized arm slowed and the reference arms slowed alike
    optimization   the optimized arm slowed, and the reference arms did not slow alike even
                   at the upper end of their speedups' 95% confidence intervals (with too
                   few pairs for an interval, or one reaching "alike": unknown, said so)
    host_or_load   a member is a load rule (queue wait): load, queueing
    one_bucket     every member is in one bucket, the optimized arm was measured there and
                   did not slow, and either every member observes real traffic (a rule of
                   source `traffic`: the canaries, the same prompts every cycle, are the
                   control) or each reference arm's speedup there did not fall by `slowed`
                   even at the lower end of its 95% confidence interval (a canary rule alone
                   cannot tell a bucket's traffic from its optimization: with no A/B pair
                   there during the incident, unknown awaiting the arms; with too few pairs
                   for an interval, or one reaching a fall: unknown, said so)
    unknown        none of these; the text says what the A/B rows showed (no optimization
                   slowed: the speedups compared; or which rows were missing)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from alerts import quality
from alerts.rollout import ROLLOUT_RULE
from alerts.rules import Rule
from alerts.series import judged_cycle, row_kind
from storage.queries.incidents import ArmRow, arm_rows
from storage.queries.speedups import (
    ALL_BUCKETS,
    ArmSpeedup,
    PairRecord,
    load_pairs,
    median_ci,
    speedups,
)
from vocab import Variant

OPTIMIZED = Variant.OPTIMIZED.value
REFERENCE = (Variant.EAGER.value, Variant.DIRECT.value)
# What the evidence says a reference arm's change was read from.
MEASURED_BY = ("reference arm vs optimized, paired per prompt within a cycle, median over "
               "pairs (storage.queries.speedups), before vs during; optimized p50 over all "
               "cycles")
CAUSES = ("host_or_load", "optimization", "one_instance", "some_instances", "one_bucket",
          "unknown")
# Family -> what the one-bucket cause names ("acceptance in bucket 32 only").
_WHAT = {"speculation": "acceptance", "latency": "latency", "quality": "output agreement",
         "memory": "memory", "compile": "recompiles", "probes": "probe failures",
         "traffic": "traffic", "load": "queue wait", "batching": "batch step cost"}
# Rule sources (alerts.rules) that observe real traffic: an incident of such members alone
# in one bucket, where the canaries' optimized arm did not slow there, is that bucket's
# traffic (the canaries run the same prompts every cycle).
TRAFFIC_SOURCES = ("traffic",)
# Families whose rules measure load itself (alerts.incidents.FAMILIES): such a member says
# requests wait, which no A/B arm can show as a slowed optimization.
LOAD_FAMILIES = ("load",)


def _ci_pairs() -> int:
    """Return the fewest pairs whose median speedup has a 95% confidence interval."""
    return next(n for n in range(1, 100) if median_ci([1.0] * n)[1] is not None)


# storage.queries.speedups gives no confidence interval under this many pairs.
CI_PAIRS = _ci_pairs()


@dataclass(frozen=True)
class CauseConfig:
    """How large a change of an arm counts as slowed, and the windows compared.

    slowed: relative change of an arm's p50 that counts as slowed (below every shipped
    latency threshold, so an arm that set off the alerts reads as slowed); alike: the
    reference arms slowed at least this share of the optimized arm's change.
    """

    slowed: float = 0.10
    alike: float = 0.5
    before_s: float = 3600.0
    # The incident's window opens at the start of the earliest rule cycle that breached
    # (`window_start`): found from the members' rules (`rules`, the evaluation's) and the
    # settle the evaluation judges them with (`settle`: row kind -> seconds, as it passes
    # it to alerts.series.RowCache). A member whose rule is not among them opens it
    # `lead_s` before it went pending (the service derives that from its schedule and
    # rules, `window_lead_s`, monitor.alerting; 60 s, one shipped cycle, where none is
    # given). The baseline hour ends `gap_s` before the window opens, so cycles at the
    # edge of the change count on neither side.
    rules: tuple[Rule, ...] = ()
    settle: Mapping[str, float] = field(default_factory=dict)
    lead_s: float = 60.0
    gap_s: float = 300.0


# Row kinds (alerts.series) whose rule cycles hold what probe cycles or traffic minutes
# measured then. A burst's cycle (a quarter hour) or a sliding hour says little of when
# the change began: a window opened that early would count the cycles before it as during.
CYCLE_KINDS = ("canary", "traffic", "batch", *quality.KINDS.values())


def window_lead_s(rules: Iterable[Rule], *, evaluate_interval_s: float,
                  settle: Mapping[str, float] | None = None) -> float:
    """Return how long before its alert went pending a rule cycle that breached started at
    most, over `rules` (the fallback of `window_start`, for a member of another rule).

    An alert goes pending at the first evaluation that judges the cycle holding the
    breach: less than one evaluation interval after that cycle ended and its rows settled
    (`settle`: row kind -> seconds, as the evaluation job passes it).
    """
    waits = settle or {}
    cycles = [r.window_s + waits.get(kind, 0.0) for r in rules
              if (kind := row_kind(r)) in CYCLE_KINDS]
    return max(cycles, default=0.0) + evaluate_interval_s


def window_start(pending: Iterable[tuple[str, datetime]], config: CauseConfig) -> datetime:
    """Return where an incident's window opens: the start of the earliest rule cycle that
    breached, over its members (`pending`: each one's rule name and when it went pending).

    A member went pending at the evaluation whose latest judged cycle of its rule breached
    (`alerts.series.judged_cycle`), so that cycle's start is exact: no cycle from before
    it counts as during the incident. Members of a burst's or a sliding hour's rule, or the
    rollout check's half hour, say little of when the change began and are left out; one
    whose rule is not in `config.rules` opens it `config.lead_s` before it went pending,
    as do all of them where none is of a rule cycle.
    """
    lead = timedelta(seconds=config.lead_s)
    rules = {r.name: r for r in config.rules}
    members = list(pending)
    starts = []
    for name, at in members:
        rule = rules.get(name)
        if rule is None and name != ROLLOUT_RULE:
            starts.append(at - lead)
        elif rule is not None and row_kind(rule) in CYCLE_KINDS:
            starts.append(judged_cycle(rule, config.settle, at))
    return min(starts or [at - lead for _, at in members])


@dataclass(frozen=True)
class Cause:
    """A probable cause: its kind, the sentence stated, and the numbers compared."""

    kind: str
    text: str
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scope:
    """What an incident's members cover (the cause reads buckets, instances, families)."""

    buckets: tuple[str, ...]
    instances: tuple[str, ...]
    families: tuple[str, ...]
    # The members' rule sources ("canary", "traffic", ...; "" where an alert states none).
    sources: tuple[str, ...] = ()


def _change(during: Sequence[float], before: Sequence[float]) -> float | None:
    if not during or not before:
        return None
    b = statistics.median(before)
    return statistics.median(during) / b - 1.0 if b > 0 else None


def _by(rows: Iterable[ArmRow], start: datetime, key: Any) -> dict[Any, tuple[list[float], list[float]]]:
    out: dict[Any, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rows:
        out[key(r)][0 if r.at >= start else 1].append(r.p50_s)
    return out


@dataclass(frozen=True)
class PairedChange:
    """A reference arm's measured speedup in one bucket, the hour before vs the incident."""

    arm: str
    bucket: str
    before: ArmSpeedup
    during: ArmSpeedup

    @property
    def change(self) -> float:
        """Return the relative change of the speedup (reference / optimized latency)."""
        return self.during.speedup / self.before.speedup - 1.0

    @property
    def high(self) -> float | None:
        """Return the change at the upper end of the incident's speedup 95% CI (None: too
        few pairs for one)."""
        if self.during.ci_high is None:
            return None
        return self.during.ci_high / self.before.speedup - 1.0

    @property
    def low(self) -> float | None:
        """Return the change at the lower end of the incident's speedup 95% CI (None: too
        few pairs for one)."""
        if self.during.ci_low is None:
            return None
        return self.during.ci_low / self.before.speedup - 1.0

    def evidence(self) -> dict[str, Any]:
        """Return the numbers compared, for the incident's evidence."""
        def side(s: ArmSpeedup) -> dict[str, Any]:
            ci = None if s.ci_low is None or s.ci_high is None else [
                round(s.ci_low, 4), round(s.ci_high, 4)]
            return {"speedup": round(s.speedup, 4), "pairs": s.pairs, "cycles": s.runs,
                    "ci95": ci}
        return {"before": side(self.before), "during": side(self.during),
                "change": round(self.change, 4)}


def paired_changes(pairs: Iterable[PairRecord], start: datetime,
                   buckets: Sequence[str] = ()) -> list[PairedChange]:
    """Return each reference arm's speedup per bucket before `start` and from it on.

    `buckets` limits the buckets read (empty: all); only buckets measured on both sides.
    """
    before: list[PairRecord] = []
    during: list[PairRecord] = []
    for p in pairs:
        if not buckets or p.bucket in buckets:
            # When its cycle finished, as its canary rows are stamped and a rule cycle
            # reads them: a cycle that began before the rule cycle that breached counts.
            (during if p.at >= start else before).append(p)

    def by_key(side: list[PairRecord]) -> dict[tuple[str, str], ArmSpeedup]:
        # One reference arm per optimization (eager: compile, direct: speculative).
        return {(s.arms[0], s.bucket): s for s in speedups(side, arms=REFERENCE)}

    was, now = by_key(before), by_key(during)
    return [PairedChange(arm, bucket, was[(arm, bucket)], now[(arm, bucket)])
            for arm, bucket in sorted(was.keys() & now.keys()) if bucket != ALL_BUCKETS]


def _optimized_changes(rows: Sequence[ArmRow], start: datetime,
                       buckets: Sequence[str]) -> dict[str, float]:
    """Return bucket -> the optimized arm's p50 change (rows at or after `start`: during)."""
    rows = [r for r in rows if r.variant == OPTIMIZED and (not buckets or r.bucket in buckets)]
    return {b: c for b, (during, before) in _by(rows, start, lambda r: r.bucket).items()
            if (c := _change(during, before)) is not None}


def arm_changes(rows: Sequence[ArmRow], paired: Sequence[PairedChange], start: datetime,
                buckets: Sequence[str] = ()) -> dict[str, float]:
    """Return arm ("optimized", "eager", "direct") -> median over buckets of its p50 change.

    `rows` are optimized canary groups: those at or after `start` are the incident's,
    earlier ones the baseline; `buckets` limits the buckets read (empty: all). A reference
    arm's change in a bucket is the optimized arm's there times the change of its paired
    speedup (`paired`), so the conditions both arms of a pair shared cancel out.
    """
    opt = _optimized_changes(rows, start, buckets)
    per: dict[str, list[float]] = defaultdict(list)
    per[OPTIMIZED] = list(opt.values())
    for pc in paired:
        if pc.bucket in opt:
            per[pc.arm].append((1.0 + opt[pc.bucket]) * (1.0 + pc.change) - 1.0)
    return {v: statistics.median(cs) for v, cs in per.items() if cs}


def arm_highs(rows: Sequence[ArmRow], paired: Sequence[PairedChange], start: datetime,
              buckets: Sequence[str] = ()) -> dict[str, float]:
    """Return reference arm -> its change as `arm_changes` reads it, at the upper end of
    the incident's speedup 95% confidence interval, median over the buckets that have one."""
    opt = _optimized_changes(rows, start, buckets)
    per: dict[str, list[float]] = defaultdict(list)
    for pc in paired:
        if pc.bucket in opt and (high := pc.high) is not None:
            per[pc.arm].append((1.0 + opt[pc.bucket]) * (1.0 + high) - 1.0)
    return {v: statistics.median(cs) for v, cs in per.items() if cs}


@dataclass(frozen=True)
class Found:
    """What the incident's window held besides the arms' changes, for `classify` to state.

    highs: reference arm -> its change at the upper end of the speedup's 95% CI
    (`arm_highs`). paired: each reference arm's speedup per bucket, before vs during.
    rows / pairs: optimized canary groups / A/B prompt pairs, before and during.
    """

    highs: Mapping[str, float] = field(default_factory=dict)
    paired: Sequence[PairedChange] = ()
    rows: tuple[int, int] = (0, 0)
    pairs: tuple[int, int] = (0, 0)

    def pairs_during(self, arms: Iterable[str]) -> int:
        """Return the most pairs one of `arms` has in the incident's window (buckets read)."""
        per: dict[str, int] = defaultdict(int)
        for pc in self.paired:
            per[pc.arm] += pc.during.pairs
        return max((per[a] for a in arms), default=0)

    def speedups(self) -> str:
        """Return each reference arm's speedup before -> during (median over buckets)."""
        out = []
        for arm in REFERENCE:
            mine = [pc for pc in self.paired if pc.arm == arm]
            if mine:
                was = statistics.median(pc.before.speedup for pc in mine)
                now = statistics.median(pc.during.speedup for pc in mine)
                out.append(f"{arm} {was:.2f}x -> {now:.2f}x over "
                           f"{sum(pc.during.pairs for pc in mine)} pairs")
        return ", ".join(out)

    def missing(self) -> str:
        """Return which rows the comparison lacked, with the counts found."""
        (rb, rd), (pb, pd) = self.rows, self.pairs
        return (f"optimized canary rows {rb} before / {rd} during, A/B pairs {pb} before / "
                f"{pd} during the incident: nothing measured on both sides")


def instance_changes(rows: Sequence[ArmRow], start: datetime) -> dict[str, float]:
    """Return instance -> median over buckets of its optimized arm's p50 change."""
    per: dict[str, list[float]] = defaultdict(list)
    groups = _by((r for r in rows if r.variant == OPTIMIZED), start,
                 lambda r: (r.instance, r.bucket))
    for (instance, _), (during, before) in sorted(groups.items()):
        c = _change(during, before)
        if c is not None:
            per[instance].append(c)
    return {i: statistics.median(cs) for i, cs in per.items()}


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def classify(scope: Scope, arms: Mapping[str, float], instances: Mapping[str, float],
             config: CauseConfig | None = None, found: Found | None = None) -> Cause:
    """Return the probable cause of an incident covering `scope` from the measured changes.

    found: the confidence intervals and counts behind `arms` (None: nothing beyond them).
    """
    cfg = config or CauseConfig()
    seen = found or Found()
    evidence: dict[str, Any] = {"arms": {k: round(v, 4) for k, v in sorted(arms.items())},
                                "arms_ci95_high": {k: round(v, 4)
                                                   for k, v in sorted(seen.highs.items())},
                                "instances": {k: round(v, 4) for k, v in sorted(instances.items())},
                                "slowed": cfg.slowed, "alike": cfg.alike}
    slowed = sorted(i for i, c in instances.items() if c >= cfg.slowed)
    if len(instances) >= 2 and slowed and len(slowed) < len(instances):
        fine = len(instances) - len(slowed)
        who = ", ".join(slowed)
        return Cause("one_instance" if len(slowed) == 1 else "some_instances",
                     f"one instance ({fine} of {len(instances)} replicas unaffected; slowed: {who})"
                     if len(slowed) == 1 else
                     f"some instances ({fine} of {len(instances)} replicas unaffected; "
                     f"slowed: {who})", evidence)
    opt = arms.get(OPTIMIZED)
    refs = [(v, arms[v]) for v in REFERENCE if v in arms]
    if opt is not None and opt >= cfg.slowed and refs:
        ref_name = "/".join(v for v, _ in refs)
        ref = statistics.median([c for _, c in refs])
        alike = max(cfg.slowed, cfg.alike * opt)
        if ref >= alike:
            return Cause("host_or_load", f"host or load (optimized and {ref_name} arms slowed "
                                         f"alike: {_pct(opt)} / {_pct(ref)})", evidence)
        # The point estimate says the reference arms did not slow alike; an optimization
        # is blamed only where the upper end of their speedups' 95% CI says so too (a few
        # pairs can read a host-wide slowdown as a regression).
        highs = [seen.highs[v] for v, _ in refs if v in seen.highs]
        if not highs:
            n = seen.pairs_during(v for v, _ in refs)
            return Cause("unknown", f"unknown (optimized {_pct(opt)}, {ref_name} {_pct(ref)}; "
                                    f"needs more A/B pairs: {n} in the incident's window, "
                                    f"{CI_PAIRS} in a bucket give a 95% confidence interval)",
                         evidence)
        high = statistics.median(highs)
        if high < alike:
            return Cause("optimization", f"optimization regressed (optimized {_pct(opt)}, "
                                         f"{ref_name} {_pct(ref)}, 95% CI up to {_pct(high)})",
                         evidence)
        return Cause("unknown", f"unknown (optimized {_pct(opt)}, {ref_name} {_pct(ref)} but "
                                f"up to {_pct(high)} within its 95% CI: host or optimization "
                                "not told apart yet)", evidence)
    if opt is not None and opt >= cfg.slowed:
        # Slowed, but no reference arm ran in the window yet: host or optimization cannot
        # be told apart (measured again while the incident is open).
        return Cause("unknown", f"unknown (optimized {_pct(opt)}, no reference arm in the "
                                "window yet)", evidence)
    measured = _measured(opt, seen, cfg)
    loads = [f for f in scope.families if f in LOAD_FAMILIES]
    if loads:
        # Requests waiting (behind real traffic or the canaries' own A/B arms) is load,
        # whatever the arms show: no optimization slowed, or nothing to compare.
        return Cause("host_or_load", f"load (queueing: {' and '.join(_WHAT[f] for f in loads)}"
                                     f" rose; {measured})", evidence)
    if len(scope.buckets) == 1:
        return _one_bucket(scope, opt, seen, cfg, measured, evidence)
    if opt is None and not any(seen.rows) and not any(seen.pairs):
        return Cause("unknown", "unknown (no A/B arm rows in the incident's window)", evidence)
    return Cause("unknown", f"unknown ({measured})", evidence)


def _one_bucket(scope: Scope, opt: float | None, seen: Found, cfg: CauseConfig,
                measured: str, evidence: dict[str, Any]) -> Cause:
    """Return the cause of an incident whose members are all in one bucket, where no arm
    slowed (or none was measured): that bucket's traffic only where the evidence says so.

    Real traffic's rules observe the traffic; the canaries' optimized arm, not slowed
    there, says the same prompts did not get slower. A canary rule alone (its p99, say,
    with the p50 not risen) cannot tell the bucket's traffic from its optimization: the
    A/B pairs in that bucket can (the optimized arm losing ground to a reference arm).
    """
    bucket = scope.buckets[0]
    fams = [f for f in scope.families if f in _WHAT] or list(scope.families)
    what = f"{' and '.join(_WHAT.get(f, f) for f in fams) or 'alerts'} in bucket {bucket} only"
    traffic = bool(scope.sources) and all(s in TRAFFIC_SOURCES for s in scope.sources)
    if opt is not None and traffic:
        return Cause("one_bucket", f"one bucket's traffic ({what})", evidence)
    here = [pc for pc in seen.paired if pc.bucket == bucket]
    if not here:
        # No evidence "paired": alerts.incidents holds the first page for the arms.
        need = "a canary cycle" if traffic else "an A/B pair"
        return Cause("unknown", f"unknown ({what}: its traffic or an optimization, not told "
                                f"apart before {need} runs there; {measured})", evidence)
    lows = [pc.low for pc in here]
    if any(low is None for low in lows):
        n = seen.pairs_during(pc.arm for pc in here)
        return Cause("unknown", f"unknown ({what}; needs more A/B pairs: {n} in the "
                                f"incident's window, {CI_PAIRS} in a bucket give a 95% "
                                f"confidence interval; {measured})", evidence)
    low = min(low for low in lows if low is not None)
    if opt is not None and low > -cfg.slowed:
        return Cause("one_bucket", f"one bucket's traffic ({what}; arm speedups held: "
                                   f"{seen.speedups()}, 95% CI down to {_pct(low)})", evidence)
    return Cause("unknown", f"unknown ({what}; {measured}; down to {_pct(low)} within its "
                            "95% CI: traffic or optimization not told apart)", evidence)


def _measured(opt: float | None, seen: Found, cfg: CauseConfig) -> str:
    """Return what the A/B rows showed where no arm explains the incident."""
    compared = seen.speedups()
    if not compared:
        if opt is not None:
            return f"no optimization slowed: optimized p50 {_pct(opt)}, no reference arm paired"
        return seen.missing()
    opt_text = f"; optimized p50 {_pct(opt)}" if opt is not None else ""
    if any(pc.change <= -cfg.slowed for pc in seen.paired):
        # The optimized arm lost ground to a reference arm without its own p50 slowing
        # (or with no p50 before the incident to compare): stated, not blamed.
        return f"a speedup fell, the optimized arm did not slow (arm speedups: {compared}" \
               + (opt_text or "; no optimized p50 before the incident") + ")"
    within = all(abs(pc.change) < cfg.slowed for pc in seen.paired)
    where = "within band" if within else "rose"
    return f"no optimization slowed (arm speedups {where}: {compared}{opt_text})"


def measure(session: Session, scope: Scope, pending: Iterable[tuple[str, datetime]],
            now: datetime, config: CauseConfig | None = None) -> Cause:
    """Read the arms around an incident and classify it; `pending`: each member's rule
    name and when it went pending (`window_start`)."""
    cfg = config or CauseConfig()
    start = window_start(pending, cfg)
    edge = start - timedelta(seconds=cfg.gap_s)
    since = edge - timedelta(seconds=cfg.before_s)
    rows = [r for r in arm_rows(session, since, now, (OPTIMIZED,)) if not edge <= r.at < start]
    pairs = [p for p in load_pairs(session, since, now) if not edge <= p.at < start]
    buckets = [b for b in scope.buckets if any(r.bucket == b for r in rows)]
    paired = paired_changes(pairs, start, buckets)
    found = Found(highs=arm_highs(rows, paired, start, buckets), paired=paired,
                  rows=(sum(r.at < start for r in rows), sum(r.at >= start for r in rows)),
                  pairs=(sum(p.at < start for p in pairs), sum(p.at >= start for p in pairs)))
    cause = classify(scope, arm_changes(rows, paired, start, buckets),
                     instance_changes(rows, start), cfg, found)
    evidence = {**cause.evidence, "window_start": start.isoformat(), "until": now.isoformat(),
                "before_s": cfg.before_s, "buckets_read": buckets or "all",
                "rows": len(rows), "measured_by": MEASURED_BY,
                "paired": {arm: {pc.bucket: pc.evidence() for pc in paired if pc.arm == arm}
                           for arm in REFERENCE if any(pc.arm == arm for pc in paired)}}
    return Cause(cause.kind, cause.text, evidence)
