"""Read one week of measurements from the database into a WeekData.

Queries take a session and never commit. Days are UTC days of the ISO week; each
aggregate is computed per day with portable SQL (sums) or in Python (weighted medians,
histograms), so SQLite and PostgreSQL give the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from monitor.report.data import (
    AcceptanceDay,
    AlertEntry,
    ArmLatency,
    BucketDay,
    FlagChange,
    LengthBin,
    MemoryPoint,
    RecompileHour,
    TrafficDay,
    WeekData,
)
from monitor.report.metrics import ARM_OPTIMIZED, BUCKET_OVERFLOW
from monitor.report.week import Week
from storage import histograms
from storage.models import (
    Alert,
    AlertTransition,
    Baseline,
    CompileEvent,
    FlagAudit,
    MemorySample,
    ProbeResult,
    ProbeRun,
    TrafficRollup,
)

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


def collect_week(session: Session, week: Week, options: CollectOptions) -> WeekData:
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
        ab=_ab(session, start, end),
        alerts=_alerts(session, start, end),
        flag_changes=_flags(session, start, end),
        kv_budget_bytes=options.kv_budget_bytes,
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


def _day(start: datetime, at: datetime) -> int:
    return min(6, max(0, (at - start).days))


def _p99(session: Session, start: datetime,
         end: datetime) -> tuple[tuple[BucketDay, ...], dict[str, float]]:
    # Canary cycles only: A/B runs alternate arms and bursts measure load, not the baseline's.
    rows = session.execute(
        select(ProbeResult.bucket, ProbeResult.at, ProbeResult.p99_s, ProbeResult.count)
        .join(ProbeRun, ProbeRun.id == ProbeResult.run_id)
        .where(ProbeResult.at >= start, ProbeResult.at < end,
               ProbeResult.variant == ARM_OPTIMIZED, ProbeResult.p99_s.is_not(None),
               ProbeRun.kind == "cycle")
    ).all()
    per_day: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    per_week: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for bucket, at, p99, count in rows:
        per_day[(bucket, _day(start, at))].append((p99, count))
        per_week[bucket].append((p99, count))
    days = tuple(BucketDay(b, d, weighted_median(v) or 0.0, sum(n for _, n in v))
                 for (b, d), v in sorted(per_day.items()))
    return days, {b: weighted_median(v) or 0.0 for b, v in per_week.items()}


def _baselines(session: Session, end: datetime) -> dict[str, float]:
    rows = session.scalars(
        select(Baseline).where(Baseline.metric == P99_METRIC, Baseline.active.is_(True),
                               Baseline.created_at < end)
        .order_by(Baseline.created_at)
    ).all()
    out: dict[str, float] = {}
    for b in rows:
        scope = b.scope or {}
        bucket = scope.get("bucket")
        if bucket is None or scope.get("source", "canary") != "canary":
            continue
        out[str(bucket)] = b.value  # later rows win: the newest active baseline
    return out


def _traffic(session: Session, start: datetime) -> tuple[
        tuple[TrafficDay, ...], tuple[AcceptanceDay, ...], tuple[LengthBin, ...]]:
    traffic: list[TrafficDay] = []
    acceptance: list[AcceptanceDay] = []
    for d in range(7):
        lo, hi = start + timedelta(days=d), start + timedelta(days=d + 1)
        rows = session.execute(
            select(TrafficRollup.bucket, TrafficRollup.path,
                   func.sum(TrafficRollup.requests), func.sum(TrafficRollup.input_tokens_sum),
                   func.sum(TrafficRollup.padded_tokens_sum), func.sum(TrafficRollup.overflow),
                   func.sum(TrafficRollup.accepted_tokens), func.sum(TrafficRollup.draft_tokens))
            .where(TrafficRollup.minute >= lo, TrafficRollup.minute < hi)
            .group_by(TrafficRollup.bucket, TrafficRollup.path)
        ).all()
        by_bucket: dict[str, list[int]] = defaultdict(lambda: [0] * 6)
        for bucket, path, req, inp, pad, over, acc, drafted in rows:
            t = by_bucket[bucket]
            over = int(over or 0)
            if not over and (bucket == BUCKET_OVERFLOW or path == "overflow"):
                over = int(req or 0)
            for i, v in enumerate((req, inp, pad, over, acc, drafted)):
                t[i] += int(v or 0) if i != 3 else over
        for bucket, (req, inp, pad, over, acc, drafted) in sorted(by_bucket.items()):
            traffic.append(TrafficDay(bucket, d, req, inp, pad, over))
            if drafted:
                acceptance.append(AcceptanceDay(bucket, d, acc, drafted))
    hist: list[int] = histograms.empty(histograms.TOKEN_EDGES)
    end = start + timedelta(days=7)
    for (h,) in session.execute(
            select(TrafficRollup.input_len_hist)
            .where(TrafficRollup.minute >= start, TrafficRollup.minute < end)):
        if h:
            hist = histograms.add(hist, h)
    return tuple(traffic), tuple(acceptance), _length_bins(hist)


def _length_bins(hist: list[int]) -> tuple[LengthBin, ...]:
    edges = histograms.TOKEN_EDGES
    out = []
    for i, c in enumerate(hist):
        lo = 1 if i == 0 else int(edges[i - 1]) + 1
        # The last bin is open-ended; report it at its lower end.
        hi = int(edges[i]) if i < len(edges) else lo
        if c:
            out.append(LengthBin(lo, hi, int(c)))
    return tuple(out)


def _canary_acceptance(session: Session, start: datetime) -> tuple[AcceptanceDay, ...]:
    out = []
    for d in range(7):
        lo, hi = start + timedelta(days=d), start + timedelta(days=d + 1)
        rows = session.execute(
            select(ProbeResult.bucket, func.sum(ProbeResult.accepted_tokens),
                   func.sum(ProbeResult.draft_tokens))
            .where(ProbeResult.at >= lo, ProbeResult.at < hi,
                   ProbeResult.variant == ARM_OPTIMIZED, ProbeResult.draft_tokens > 0)
            .group_by(ProbeResult.bucket)
        ).all()
        out += [AcceptanceDay(b, d, int(a or 0), int(p or 0)) for b, a, p in sorted(rows) if p]
    return tuple(out)


def _memory(session: Session, start: datetime, end: datetime) -> tuple[MemoryPoint, ...]:
    rows = session.execute(
        select(MemorySample.at, MemorySample.rss_bytes, MemorySample.kv_cache_bytes,
               MemorySample.instance_id)
        .where(MemorySample.at >= start, MemorySample.at < end)
        .order_by(MemorySample.at)
    ).all()
    return tuple(MemoryPoint(at, rss, kv or 0, instance=inst) for at, rss, kv, inst in rows)


def _recompiles(session: Session, start: datetime, end: datetime,
                warmup_s: float) -> tuple[RecompileHour, ...]:
    first = dict(session.execute(
        select(CompileEvent.instance_id, func.min(CompileEvent.at))
        .where(CompileEvent.at < end).group_by(CompileEvent.instance_id)
    ).all())
    rows = session.execute(
        select(CompileEvent.at, CompileEvent.instance_id, CompileEvent.recompiles,
               CompileEvent.limit_hits)
        .where(CompileEvent.at >= start, CompileEvent.at < end)
    ).all()
    hours: dict[datetime, list[int]] = defaultdict(lambda: [0, 0, 0])
    for at, inst, recompiles, limit_hits in rows:
        h = hours[at.replace(minute=0, second=0, microsecond=0)]
        h[0] += recompiles or 0
        h[2] += limit_hits or 0
        warm_done = first[inst] + timedelta(seconds=warmup_s)
        if at > warm_done:
            h[1] += recompiles or 0
    return tuple(RecompileHour(h, *v) for h, v in sorted(hours.items()) if any(v))


def _ab(session: Session, start: datetime, end: datetime) -> tuple[ArmLatency, ...]:
    rows = session.execute(
        select(ProbeResult.variant, ProbeResult.bucket, ProbeResult.at, ProbeResult.p50_s,
               ProbeResult.count)
        .join(ProbeRun, ProbeRun.id == ProbeResult.run_id)
        .where(ProbeResult.at >= start, ProbeResult.at < end, ProbeRun.kind == "ab",
               ProbeResult.p50_s.is_not(None))
    ).all()
    week: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    days: dict[tuple[str, str, int], list[tuple[float, int]]] = defaultdict(list)
    for variant, bucket, at, p50, count in rows:
        week[(variant, bucket)].append((p50, count))
        days[(variant, bucket, _day(start, at))].append((p50, count))
    out = [ArmLatency(v, b, weighted_median(x) or 0.0, sum(n for _, n in x))
           for (v, b), x in sorted(week.items())]
    out += [ArmLatency(v, b, weighted_median(x) or 0.0, sum(n for _, n in x), d)
            for (v, b, d), x in sorted(days.items())]
    return tuple(out)


def _alerts(session: Session, start: datetime, end: datetime) -> tuple[AlertEntry, ...]:
    moved = select(AlertTransition.alert_id).where(AlertTransition.at >= start,
                                                   AlertTransition.at < end)
    alerts = session.scalars(
        select(Alert).where(
            Alert.fired_at.is_not(None), Alert.fired_at < end,
            or_(Alert.resolved_at.is_(None), Alert.resolved_at >= start, Alert.id.in_(moved)))
        .order_by(Alert.fired_at, Alert.id)
    ).all()
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
    rows = session.scalars(
        select(FlagAudit).where(FlagAudit.at >= start, FlagAudit.at < end)
        .order_by(FlagAudit.at, FlagAudit.id)
    ).all()
    out = []
    for r in rows:
        flag = r.name if r.scope in ("", "global") else f"{r.name}[{r.scope}]"
        actor = f"{r.actor or 'unknown'} ({r.source})"
        out.append(FlagChange(r.at, flag, None if r.old_value is None else str(r.old_value),
                              f"{r.action} {r.new_value}" if r.new_value is not None
                              else r.action, actor, r.reason or ""))
    return tuple(out)
