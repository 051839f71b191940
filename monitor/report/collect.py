"""Read one week of measurements from the database into a WeekData.

The rows come from `storage.queries` (frames via pandas.read_sql, taken inside the
caller's transaction); days are UTC days of the ISO week and the per-day and per-hour
aggregates are pandas groupbys here, so SQLite and PostgreSQL give the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any, cast

import pandas as pd
from sqlalchemy.orm import Session

from monitor.report.data import (
    AcceptanceDay,
    AlertEntry,
    BatchingWeek,
    BucketDay,
    BurstPair,
    DaySpeedup,
    FlagChange,
    LengthBin,
    MemoryPoint,
    OnDemandPairs,
    RecompileHour,
    TrafficDay,
    WeekData,
)
from monitor.report.deliveries import collect_dead_letters
from monitor.report.incidents import collect_incidents
from monitor.report.metrics import ARM_OPTIMIZED, BUCKET_OVERFLOW
from monitor.report.quality import collect_quality
from monitor.report.rollouts import collect_rollouts
from monitor.report.sensitivity import collect_sensitivity
from monitor.report.week import Period
from storage.models import Alert
from storage.queries import alerts as alert_queries
from storage.queries import flags as flag_queries
from storage.queries import latency, measurements
from storage.queries import week as queries
from storage.queries.baselines import baselines_in_force
from storage.queries.batching import batch_loop, batch_usage
from storage.queries.runs import current_cohort
from storage.queries.speedups import PairRecord, load_pairs, scheduled, speedups

P99_METRIC = "p99_latency"  # the Baseline metric the alert rules keep per bucket


@dataclass(frozen=True)
class CollectOptions:
    """What the queries need besides the week.

    buckets: configured bucket edges; kv_budget_bytes: the KV cache's memory budget;
    warmup_s: compile events within this many seconds of an instance's first compile
        event count as warm-up.
    """

    buckets: tuple[int, ...]
    kv_budget_bytes: int | None = None
    warmup_s: float = 1800.0


def collect_week(session: Session, week: Period, options: CollectOptions) -> WeekData:
    """Return every measurement of `week` the report needs."""
    start, end = week.start, week.end
    p99, p99_week = _p99(session, start, end)
    baseline = _baselines(session, end) or _p99(session, start - timedelta(days=7), start)[1]
    traffic, acceptance_traffic, lengths = _traffic(session, start)
    acceptance = acceptance_traffic or _canary_acceptance(session, start)
    return WeekData(
        week=week,
        buckets=tuple(options.buckets),
        p99=p99,
        p99_week=p99_week,
        baseline_p99=baseline,
        acceptance=acceptance,
        traffic=traffic,
        lengths=lengths,
        memory=_memory(session, start, end),
        recompiles=_recompiles(session, start, end, options.warmup_s),
        **_ab(session, start, end),
        alerts=_alerts(session, start, end),
        flag_changes=_flags(session, start, end),
        kv_budget_bytes=options.kv_budget_bytes,
        quality=collect_quality(session, start, end),
        rollouts=collect_rollouts(session, start, end),
        sensitivity=collect_sensitivity(session),
        dead_letters=collect_dead_letters(session, start, end),
        incidents=collect_incidents(session, start, end),
        batching=collect_batching(session, start, end),
        window_note=f"{start.isoformat()} <= at < {end.isoformat()}",
    )


def weighted_median(pairs: Iterable[tuple[float, int]]) -> float | None:
    """Return the median of values weighted by counts (the lower median on a tie)."""
    items = sorted((v, max(int(n), 1)) for v, n in pairs)
    total = sum(n for _, n in items)
    if not total:
        return None
    seen = 0
    for v, n in items:
        seen += n
        if seen * 2 >= total:
            return v
    return items[-1][0]


def _days(at: pd.Series, start: datetime) -> pd.Series:
    """Return the day of the week (0..6) of each timestamp."""
    return ((at - pd.Timestamp(start)).dt.days).clip(0, 6).astype(int)


def _day_numbers(days: pd.Series, start: datetime) -> list[int]:
    """Return the day of the week (0..6) of each 'YYYY-MM-DD' UTC day."""
    return [(date.fromisoformat(d) - start.date()).days for d in days]


def _groups(df: pd.DataFrame, keys: list[str]) -> Iterator[tuple[tuple[Any, ...], pd.DataFrame]]:
    """Yield (key values, rows) of each group, in key order."""
    for key, rows in df.groupby(keys):
        yield cast(tuple[Any, ...], key), rows


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], df.to_dict("records"))


def _median_of(g: pd.DataFrame, value: str) -> float:
    return float(weighted_median(zip(g[value], g["count"], strict=True)) or 0.0)


def _p99(session: Session, start: datetime,
         end: datetime) -> tuple[tuple[BucketDay, ...], dict[str, float]]:
    # Optimized canaries of cycles only: the A/B arms and bursts are not what baselines keep.
    df = queries.canary_results_frame(session, start, end, kind="cycle", variant=ARM_OPTIMIZED)
    df = df[df["p99_s"].notna()].assign(day=lambda d: _days(d["at"], start))
    days = tuple(BucketDay(str(b), int(d), _median_of(g, "p99_s"), int(g["count"].sum()))
                 for (b, d), g in _groups(df, ["bucket", "day"]))
    return days, {str(b): _median_of(g, "p99_s") for (b,), g in _groups(df, ["bucket"])}


def _baselines(session: Session, end: datetime) -> dict[str, float]:
    cohort = current_cohort(session, end).key
    out: dict[str, tuple[datetime, float]] = {}
    for force in baselines_in_force(session, P99_METRIC, cohort).values():
        b = force.baseline
        if b is None or b.created_at >= end:
            continue
        bucket = b.scope.get("bucket")
        if bucket is None or b.scope.get("source", "canary") != "canary":
            continue
        # Several scopes (paths, decodings) per bucket: the newest baseline in force speaks.
        if str(bucket) not in out or b.created_at > out[str(bucket)][0]:
            out[str(bucket)] = (b.created_at, b.value)
    return {k: v for k, (_, v) in out.items()}


def _traffic(session: Session, start: datetime) -> tuple[
        tuple[TrafficDay, ...], tuple[AcceptanceDay, ...], tuple[LengthBin, ...]]:
    end = start + timedelta(days=7)
    df = queries.traffic_sums_frame(session, start, end)
    sums = ["requests", "input_tokens", "padded_tokens", "overflow", "accepted", "drafted"]
    df = df.assign(day=_day_numbers(df["day"], start))
    df[sums] = df[sums].fillna(0).astype(int)
    per_path = df.groupby(["day", "bucket", "path"], as_index=False)[sums].sum()
    # Rows of the overflow bucket or path that did not count overflow: every request overflowed.
    implied = (per_path["overflow"] == 0) & (
        (per_path["bucket"] == BUCKET_OVERFLOW) | (per_path["path"] == "overflow"))
    per_path.loc[implied, "overflow"] = per_path.loc[implied, "requests"]
    per_bucket = per_path.groupby(["day", "bucket"], as_index=False)[sums].sum()
    rows = _records(per_bucket)
    traffic = tuple(TrafficDay(str(r["bucket"]), int(r["day"]), int(r["requests"]),
                               int(r["input_tokens"]), int(r["padded_tokens"]), int(r["overflow"]))
                    for r in rows)
    acceptance = tuple(AcceptanceDay(str(r["bucket"]), int(r["day"]), int(r["accepted"]),
                                     int(r["drafted"]))
                       for r in rows if r["drafted"])
    # Exact lengths: one width-1 bin per observed input length.
    lengths = tuple(LengthBin(n, n, c) for n, c in queries.input_lengths(session, start, end))
    return traffic, acceptance, lengths


def _canary_acceptance(session: Session, start: datetime) -> tuple[AcceptanceDay, ...]:
    df = queries.canary_acceptance_frame(session, start, start + timedelta(days=7),
                                         variant=ARM_OPTIMIZED)
    df = df.assign(day=_day_numbers(df["day"], start))
    df[["accepted", "drafted"]] = df[["accepted", "drafted"]].fillna(0).astype(int)
    sums = df.groupby(["day", "bucket"], as_index=False)[["accepted", "drafted"]].sum()
    return tuple(AcceptanceDay(str(r["bucket"]), int(r["day"]), int(r["accepted"]),
                               int(r["drafted"]))
                 for r in _records(sums) if r["drafted"])


def _memory(session: Session, start: datetime, end: datetime) -> tuple[MemoryPoint, ...]:
    df = queries.memory_frame(session, start, end)
    kv = df["kv_cache_bytes"].fillna(0).astype(int).tolist()
    return tuple(MemoryPoint(at, int(rss), k, instance=str(inst)) for at, rss, k, inst in zip(
        [t.to_pydatetime() for t in df["at"]], df["rss_bytes"].tolist(), kv, df["instance_id"],
        strict=True))


def _recompiles(session: Session, start: datetime, end: datetime,
                warmup_s: float) -> tuple[RecompileHour, ...]:
    df = queries.compile_frame(session, start, end)
    df[["recompiles", "limit_hits"]] = df[["recompiles", "limit_hits"]].fillna(0).astype(int)
    warm = df["at"] > df["first_at"] + pd.Timedelta(seconds=warmup_s)
    df = df.assign(hour=df["at"].dt.floor("h"), after_warmup=df["recompiles"].where(warm, 0))
    hours = df.groupby("hour", as_index=False)[["recompiles", "after_warmup", "limit_hits"]].sum()
    return tuple(RecompileHour(r["hour"].to_pydatetime(), int(r["recompiles"]),
                               int(r["after_warmup"]), int(r["limit_hits"]))
                 for r in _records(hours)
                 if r["recompiles"] or r["after_warmup"] or r["limit_hits"])


def _ab(session: Session, start: datetime, end: datetime) -> dict[str, Any]:
    """Return the week's measured speedups (storage.queries.speedups) and each day's, of
    the drawn and requested A/B cycles; and what the cycles run on demand would add."""
    pairs, on_demand = scheduled(load_pairs(session, start, end))
    by_day: dict[int, list[PairRecord]] = {}
    for p in pairs:
        by_day.setdefault(min(max((p.started_at - start).days, 0), 6), []).append(p)
    daily = tuple(DaySpeedup(d, s) for d, ps in sorted(by_day.items()) for s in speedups(ps))
    left_out = OnDemandPairs(len({p.run_id for p in on_demand}), len(on_demand),
                             tuple(speedups(on_demand)))
    return {"ab": tuple(speedups(pairs)), "ab_daily": daily, "ab_on_demand": left_out}


def _alerts(session: Session, start: datetime, end: datetime) -> tuple[AlertEntry, ...]:
    alerts = alert_queries.alerts_active_between(session, start, end)
    out = []
    for a in alerts:
        steps = tuple(
            f"{t.at:%Y-%m-%d %H:%MZ} {t.from_state or 'new'} -> {t.to_state}"
            + (f" ({t.reason})" if t.reason else "")
            for t in a.transitions if start <= t.at < end)
        summary = (a.annotations or {}).get("summary") or _alert_numbers(a)
        out.append(AlertEntry(a.rule, (a.labels or {}).get("bucket"), a.severity,
                              a.fired_at, a.resolved_at, summary, steps))  # type: ignore[arg-type]
    return tuple(out)


def _alert_numbers(a: Alert) -> str:
    if a.value is None:
        return a.state
    base = f" vs baseline {a.baseline:.4g}" if a.baseline is not None else ""
    return f"{a.state}: value {a.value:.4g}{base}"


def _flags(session: Session, start: datetime, end: datetime) -> tuple[FlagChange, ...]:
    rows = flag_queries.flag_audits(session, since=start, until=end, limit=None,
                                    oldest_first=True)
    out = []
    for r in rows:
        flag = r.name if r.scope in ("", "global") else f"{r.name}[{r.scope}]"
        actor = f"{r.actor or 'unknown'} ({r.source})"
        out.append(FlagChange(r.at, flag, None if r.old_value is None else str(r.old_value),
                              f"{r.action} {r.new_value}" if r.new_value is not None
                              else r.action, actor, r.reason or ""))
    return tuple(out)


def collect_batching(session: Session, start: datetime, end: datetime) -> BatchingWeek:
    """Return the week's batching: traffic by batch-size class, the loop, the burst arms."""
    day = timedelta(days=1)
    return BatchingWeek(
        usage=tuple(batch_usage(session, start, end)),
        usage_daily=tuple(tuple(batch_usage(session, start + i * day, start + (i + 1) * day))
                          for i in range(7)),
        loop=tuple(batch_loop(session, start, end)),
        token_p50_s=latency.sketch(session, start, end, field="per_token").quantile(0.5),
        bursts=_burst_pairs(session, start, end))


def _burst_pairs(session: Session, start: datetime, end: datetime) -> tuple[BurstPair, ...]:
    """Return the bursts whose batched and unbatched arms both completed requests."""
    arms: dict[str, dict[str, Any]] = {}
    for run in measurements.burst_runs(session, start, end):
        d = run.details or {}
        if d.get("pair") and d.get("latency_p99_s") is not None:
            arms.setdefault(d["pair"], {})[d.get("variant", "optimized")] = run
    out = []
    for pair in arms.values():
        b, u = pair.get("optimized"), pair.get("unbatched")
        if b is None or u is None:
            continue
        out.append(BurstPair(
            day=(b.started_at - start).days, instance=b.instance_id,
            batched_per_s=float(b.details.get("throughput_per_s") or 0.0),
            unbatched_per_s=float(u.details.get("throughput_per_s") or 0.0),
            batched_p99_s=float(b.details["latency_p99_s"]),
            unbatched_p99_s=float(u.details["latency_p99_s"])))
    return tuple(sorted(out, key=lambda p: (p.day, p.instance)))
