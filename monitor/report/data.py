"""What one week of measurements looks like to the report: plain frozen rows, no SQL.

`collect.collect_week` fills a WeekData from the database; tests may build one by hand.
Day indexes run 0 (Monday) to 6 (Sunday) of the week under review.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from monitor.report.week import Period
from storage.queries.batching import BatchLoop, BatchUsage
from storage.queries.speedups import ArmSpeedup


@dataclass(frozen=True)
class BucketDay:
    """Latency of one bucket on one day (optimized path, canary probes)."""

    bucket: str
    day: int
    p99_s: float
    n: int


@dataclass(frozen=True)
class AcceptanceDay:
    """Speculative-decoding counters of one bucket on one day (real traffic and canaries)."""

    bucket: str
    day: int
    accepted: int
    proposed: int


@dataclass(frozen=True)
class TrafficDay:
    """Real-traffic request and token counts of one bucket on one day.

    input_tokens: real tokens; padded_tokens: tokens after padding to the bucket edge.
    overflow: requests longer than the largest bucket (the "overflow" bucket's rows
    count all their requests as overflow when this is 0).
    """

    bucket: str
    day: int
    requests: int
    input_tokens: int
    padded_tokens: int
    overflow: int = 0

    @property
    def overflowed(self) -> int:
        """Return how many of these requests did not fit the largest bucket."""
        if self.overflow:
            return self.overflow
        return self.requests if self.bucket == "overflow" else 0


@dataclass(frozen=True)
class LengthBin:
    """Real inputs whose token count lies in [lo, hi] (inclusive)."""

    lo: int
    hi: int
    count: int


@dataclass(frozen=True)
class MemoryPoint:
    """One memory sample."""

    at: datetime
    rss_bytes: int
    kv_cache_bytes: int
    kv_budget_bytes: int | None = None
    instance: str = ""


@dataclass(frozen=True)
class RecompileHour:
    """Compile events in one hour; after_warmup counts recompiles once warm-up was done."""

    hour: datetime
    recompiles: int
    after_warmup: int
    limit_hits: int = 0


@dataclass(frozen=True)
class OnDemandPairs:
    """The week's A/B pairs its speedups leave out: cycles that ran the arms on demand.

    The arms also run in the cycle after a slow one (details["ab_reason"] "slowdown",
    probes.ab_schedule); those crowd into slow periods, so the week's speedups read the
    drawn and requested cycles only (storage.queries.speedups.scheduled).
    cycles / prompts: how many such cycles, and prompt pairs in them; speedups: their
    pairs per bucket x optimization (read for the counts, `pairs`; not reported).
    """

    cycles: int = 0
    prompts: int = 0
    speedups: tuple[ArmSpeedup, ...] = ()

    def pairs(self, optimization: str, bucket: str) -> int:
        """Return the pairs left out for `optimization` in `bucket` (or ALL_BUCKETS)."""
        return next((s.pairs for s in self.speedups
                     if s.optimization == optimization and s.bucket == bucket), 0)


@dataclass(frozen=True)
class DaySpeedup:
    """The measured speedups (storage.queries.speedups) of the A/B cycles of one day."""

    day: int
    speedup: ArmSpeedup


@dataclass(frozen=True)
class AlertEntry:
    """An alert that fired, changed or resolved during the week."""

    name: str
    bucket: str | None
    severity: str
    fired_at: datetime
    resolved_at: datetime | None
    summary: str
    transitions: tuple[str, ...] = ()  # "2026-11-24T03:00Z firing -> resolved (why)"


@dataclass(frozen=True)
class FlagChange:
    """One audited flag change: who or what changed it and why."""

    at: datetime
    flag: str
    old: str | None
    new: str
    actor: str
    reason: str


@dataclass(frozen=True)
class DeadLetterRow:
    """The week's dead letters of one webhook target."""

    target: str
    count: int
    oldest: datetime
    reason: str  # the most frequent one
    other_reasons: int  # distinct reasons besides it


@dataclass(frozen=True)
class IncidentRow:
    """One incident of the week (or one late run: incident None)."""

    incident: int | None
    started_at: datetime
    resolved_at: datetime | None
    severity: str
    cause: str
    members: tuple[str, ...]
    notifications: int


@dataclass(frozen=True)
class QualityRow:
    """Agreement of one (source, bucket, arm) over the week."""

    source: str
    bucket: str
    arm: str
    compared: int
    exact: int
    agreement: float | None
    first_divergence: int | None
    worst: tuple[dict[str, Any], ...] = ()
    golden_compared: int = 0  # outputs checked against a golden answer (`expected`)
    golden_exact: int = 0


@dataclass(frozen=True)
class RolloutRow:
    """The latest verdict of one new cohort vs an old one for one source, metric and bucket."""

    new: str
    old: str
    source: str
    metric: str
    bucket: str
    verdict: str
    relative_change: float | None
    p_value: float | None
    cycles: int
    last_at: datetime


@dataclass(frozen=True)
class SensitivityRow:
    """What one rule can see on one series."""

    rule: str
    scope: str
    cohort: str
    detectable: str
    false_pages: str
    threshold: str
    why: str


@dataclass(frozen=True)
class BurstPair:
    """One burst's batched arm and its unbatched arm (same arrivals, same instance)."""

    day: int
    instance: str
    batched_per_s: float  # completed requests per second of the burst
    unbatched_per_s: float
    batched_p99_s: float
    unbatched_p99_s: float


@dataclass(frozen=True)
class BatchingWeek:
    """Continuous batching over the week (storage.queries.batching, the burst's arms).

    usage: real traffic per bucket x batch-size class x decoding, the whole week;
    usage_daily: the same per day (0..6); loop: the batching loop per instance;
    token_p50_s: real traffic's p50 time per output token (the window's yardstick).
    """

    usage: tuple[BatchUsage, ...] = ()
    usage_daily: tuple[tuple[BatchUsage, ...], ...] = ()
    loop: tuple[BatchLoop, ...] = ()
    token_p50_s: float | None = None
    bursts: tuple[BurstPair, ...] = ()


@dataclass(frozen=True)
class WeekData:
    """Every measurement the report needs for one week."""

    week: Period
    buckets: tuple[int, ...]
    p99: tuple[BucketDay, ...] = ()
    p99_week: Mapping[str, float] = field(default_factory=dict)
    baseline_p99: Mapping[str, float] = field(default_factory=dict)
    acceptance: tuple[AcceptanceDay, ...] = ()
    traffic: tuple[TrafficDay, ...] = ()
    lengths: tuple[LengthBin, ...] = ()
    memory: tuple[MemoryPoint, ...] = ()
    recompiles: tuple[RecompileHour, ...] = ()
    # Measured speedups (storage.queries.speedups: paired per prompt) per bucket and over
    # all buckets, of the drawn and requested A/B cycles; the on-demand ones left out.
    ab: tuple[ArmSpeedup, ...] = ()
    ab_daily: tuple[DaySpeedup, ...] = ()
    ab_on_demand: OnDemandPairs = field(default_factory=OnDemandPairs)
    alerts: tuple[AlertEntry, ...] = ()
    flag_changes: tuple[FlagChange, ...] = ()
    kv_budget_bytes: int | None = None
    # Outputs vs the reference path per (source, bucket, arm) (monitor.report.quality).
    quality: tuple[QualityRow, ...] = ()
    # New cohorts judged against old ones (monitor.report.rollouts).
    rollouts: tuple[RolloutRow, ...] = ()
    # What each rule can see per series (monitor.report.sensitivity).
    sensitivity: tuple[SensitivityRow, ...] = ()
    # Webhook notifications of the week given up on, per target (monitor.report.deliveries).
    dead_letters: tuple[DeadLetterRow, ...] = ()
    incidents: tuple[IncidentRow, ...] = ()  # alerts grouped (monitor.report.incidents)
    batching: BatchingWeek = field(default_factory=BatchingWeek)
    window_note: str = ""  # how the queries selected rows, shown as evidence

    @property
    def has_data(self) -> bool:
        """Return whether any measurement fell into the week."""
        return bool(self.p99 or self.acceptance or self.traffic or self.lengths
                    or self.memory or self.recompiles or self.ab
                    or self.ab_on_demand.cycles)

    def bucket_labels(self) -> tuple[str, ...]:
        """Return the configured bucket labels, smallest first."""
        return tuple(str(b) for b in self.buckets)
