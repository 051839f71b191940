"""Background jobs on APScheduler 3.x: probes on every replica, singletons on the leader.

Jobs (names are the keys of the `jobs` mapping given to `build_scheduler`):
    probe, burst, traffic_flush          every replica (rows carry instance_id)
    evaluate, delivery, retention, report  only on the replica holding the leader lock
    memory_trim                          every process with a scheduler (serve, worker)
A job whose callable is not given is not scheduled. Every job runs with
max_instances=1 and coalesce=True, so a slow run is never overlapped by its next
trigger and a backlog of missed triggers runs once; misfire_grace_time from settings.
The serving process's housekeeping (burst, traffic_flush, memory_trim) starts off the
probe job's beat (OFF_PROBE_BEAT).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from monitor.leader import LeaderLock
from monitor.priority import analysis_executor
from storage.errors import DatabaseUnavailable
from vocab import utcnow

if TYPE_CHECKING:
    from monitor.job_metrics import JobMetrics
    from monitor.settings import Settings

log = logging.getLogger(__name__)

PROBE = "probe"
BURST = "burst"
TRAFFIC_FLUSH = "traffic_flush"
EVALUATE = "evaluate"
DELIVERY = "delivery"
RETENTION = "retention"
REPORT = "report"
SENSITIVITY = "sensitivity"
MEMORY_TRIM = "memory_trim"
EVERY_REPLICA = (PROBE, BURST, TRAFFIC_FLUSH)
SINGLETONS = (EVALUATE, DELIVERY, RETENTION, REPORT, SENSITIVITY)
EVERY_PROCESS = (MEMORY_TRIM,)  # each process trims its own heap
ANALYSIS_EXECUTOR = "analysis"  # the singletons' threads, at nice worker.nice

Job = Callable[[], object]


@dataclass(frozen=True)
class JobStats:
    """How one job has fared since start-up."""

    name: str
    singleton: bool
    runs: int = 0  # runs finished
    failures: int = 0
    not_leader: int = 0  # triggers skipped because another replica leads
    running: bool = False
    last_started_at: datetime | None = None
    last_finished_at: datetime | None = None
    last_error: str | None = None
    started: int = 0  # runs started (a running one included)
    last_duration_s: float | None = None
    last_success_at: datetime | None = None
    leader: bool | None = None  # singletons: whether this process led at the last trigger


def job_table(stats: Mapping[str, JobStats]) -> list[dict[str, object]]:
    """Return one JSON-ready row per job: runs, failures, last success and duration, leader."""
    return [{"name": s.name, "runs": s.runs, "failures": s.failures,
             "last_success": s.last_success_at.isoformat() if s.last_success_at else None,
             "last_duration_s": s.last_duration_s, "running": s.running,
             "singleton": s.singleton, "leader": s.leader, "not_leader": s.not_leader,
             "last_error": s.last_error}
            for s in sorted(stats.values(), key=lambda s: s.name)]


class JobScheduler:
    """A BackgroundScheduler with the leader lock and per-job stats."""

    def __init__(self, aps: BackgroundScheduler, leader: LeaderLock,
                 clock: Callable[[], datetime], metrics: JobMetrics | None = None) -> None:
        self.aps = aps
        self.leader = leader
        self.clock = clock
        self.metrics = metrics
        self._stats: dict[str, JobStats] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a run finishes

    def add(self, name: str, fn: Job, trigger: BaseTrigger, *, singleton: bool,
            misfire_grace_s: int, executor: str = "default") -> None:
        """Schedule `fn` under `name` on `executor` (singletons only run while this replica
        leads)."""
        with self._lock:
            self._stats[name] = JobStats(name, singleton)
        if self.metrics is not None:
            self.metrics.track(name)
        self.aps.add_job(self._wrap(name, fn, singleton), trigger, id=name, name=name,
                         executor=executor, max_instances=1, coalesce=True,
                         misfire_grace_time=misfire_grace_s, replace_existing=True)

    def _update(self, name: str, **changes: Any) -> None:
        with self._lock:
            self._stats[name] = replace(self._stats[name], **changes)

    def _wrap(self, name: str, fn: Job, singleton: bool) -> Callable[[], None]:
        streak = [0]  # consecutive failed runs
        kinds: set[str] = set()  # failures already logged in this streak

        def run() -> None:
            if singleton and not self._leads(name):
                return
            with self._lock:
                s = self._stats[name]
                self._stats[name] = replace(s, running=True, started=s.started + 1,
                                            last_started_at=self.clock())
            began = time.perf_counter()
            ok = False
            try:
                result = fn()
            except Exception as exc:
                streak[0] += 1
                self._update(name, failures=self._stats[name].failures + 1,
                             last_error=f"{type(exc).__name__}: {exc}")
                _log_failure(name, exc, streak, kinds)
            else:
                ok = True
                if streak[0]:
                    log.info("scheduled job %s: recovered after %d failed run(s)", name,
                             streak[0])
                streak[0] = 0
                kinds.clear()
                _log_outcome(name, result)
            finally:
                self._finished(name, time.perf_counter() - began, ok)

        run.__name__ = f"job_{name}"
        return run

    def _leads(self, name: str) -> bool:
        leads = self.leader.is_leader()
        with self._lock:
            s = self._stats[name]
            self._stats[name] = replace(s, leader=leads,
                                        not_leader=s.not_leader + (0 if leads else 1))
        return leads

    def _finished(self, name: str, duration_s: float, ok: bool) -> None:
        now = self.clock()
        with self._lock:
            s = self._stats[name]
            self._stats[name] = replace(
                s, runs=s.runs + 1, running=False, last_finished_at=now,
                last_duration_s=duration_s, last_success_at=now if ok else s.last_success_at)
            self._idle.notify_all()
        if self.metrics is not None:
            self.metrics.observe(name, duration_s, ok=ok, finished_at=now.timestamp())

    def activity(self) -> Mapping[str, tuple[int, bool]]:
        """Return job name -> (runs started so far, running now).

        A prober compares two readings to learn whether any job ran in this process
        while it measured.
        """
        with self._lock:
            return {n: (s.started, s.running) for n, s in self._stats.items()}

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job is running; return whether that happened within `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(
                lambda: not any(s.running for s in self._stats.values()), timeout_s)

    def stats(self) -> dict[str, JobStats]:
        """Return a snapshot of every job's stats."""
        with self._lock:
            return dict(self._stats)

    def jobs(self) -> list[str]:
        """Return the scheduled job names."""
        return [j.id for j in self.aps.get_jobs()]

    def start(self) -> None:
        """Start the background thread."""
        self.aps.start()

    def shutdown(self, *, wait: bool = True) -> None:
        """Stop scheduling, optionally wait for running jobs, then give up leadership."""
        if self.aps.running:
            self.aps.shutdown(wait=wait)
        self.leader.release()
        if self.metrics is not None:
            metrics, self.metrics = self.metrics, None
            metrics.unregister()


def _is_database_down(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError | PoolTimeout | DatabaseUnavailable) or bool(
        isinstance(exc, DBAPIError) and exc.connection_invalidated)


def _log_failure(name: str, exc: Exception, streak: list[int], kinds: set[str]) -> None:
    # A database outage fails every job every few seconds: one warning when it starts, a
    # recovery line when it ends (run() logs it), no traceback per run.
    kind = "database" if _is_database_down(exc) else type(exc).__name__
    if kind in kinds:
        log.debug("scheduled job %s failed again (%d in a row): %s", name, streak[0], exc)
        return
    kinds.add(kind)
    if kind == "database":
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        log.warning("scheduled job %s: database unavailable (%s: %s); retrying each run, "
                    "quietly until it recovers", name, type(exc).__name__,
                    first[0] if first else "")
    else:
        log.exception("scheduled job %s failed", name)


def _log_outcome(name: str, result: object) -> None:
    # A probe run stores its failure as a row and returns normally: say so in the log.
    status = getattr(result, "status", None)
    if isinstance(status, str) and status != "ok":
        log.warning("scheduled job %s: run ended %s: %s", name, status,
                    getattr(result, "error", None) or "no error text")


def cron(expr: str, field: str) -> CronTrigger:
    """Return a UTC CronTrigger for a crontab expression; ValueError names the field."""
    try:
        return CronTrigger.from_crontab(expr, timezone=UTC)
    except ValueError as exc:
        raise ValueError(f"{field}: invalid crontab expression {expr!r} ({exc})") from exc


def interval(seconds: float, field: str, start: datetime | None = None) -> IntervalTrigger:
    """Return an IntervalTrigger first firing at `start` (default: one interval from now);
    ValueError names the field."""
    if seconds <= 0:
        raise ValueError(f"{field}: must be > 0 seconds, got {seconds}")
    return IntervalTrigger(seconds=seconds, start_date=start, timezone=UTC)


# Where in the probe job's beat each housekeeping job of the serving process fires. Started
# together, a job whose interval shares a beat with the probe's fires with a probe cycle's
# start at every common multiple of the two intervals: the coupling that biased the
# evaluation when it shared the probe's interval and start. Its work then lands on the
# canaries each cycle measures first (the first bucket's), so that bucket's numbers, and
# the ratios drawn from them, carry the monitor's own cost and the other buckets' do not.
# Two interval jobs whose starts are d apart fire together only if d is a whole multiple of
# their common beat (the longest interval both intervals are multiples of): a start offset
# by a fraction of that beat strictly between 0 and 1 never meets a probe start. The
# fractions also keep the three apart from each other at the shipped intervals and at
# 10-s probe cycles. The trim (a heap walk under glibc's lock) sits halfway between
# cycles, where a cycle has most likely ended. A burst and a cycle never overlap anyway
# (monitor.probe_runner runs one at a time): off the beat, a burst no longer delays a
# cycle's start.
OFF_PROBE_BEAT = {MEMORY_TRIM: 0.5, TRAFFIC_FLUSH: 0.5, BURST: 0.75}


def common_beat_s(a: float, b: float) -> float:
    """Return the longest interval that both `a` and `b` are whole multiples of (1-ms grid)."""
    ms_a, ms_b = round(a * 1000), round(b * 1000)
    if ms_a <= 0 or ms_b <= 0:
        return min(a, b)
    return math.gcd(ms_a, ms_b) / 1000


def triggers(settings: Settings, now: datetime | None = None) -> dict[str, BaseTrigger]:
    """Return each job's trigger from settings (probe jobs left out when disabled).

    Interval jobs count from `now` (default: the current time): each first fires one
    interval later, and the OFF_PROBE_BEAT jobs their offset after that.
    """
    s = settings.scheduler
    anchor = now or utcnow()
    probe_s = s.probe_interval_s

    def off_beat(name: str, seconds: float, field: str) -> IntervalTrigger:
        beat = common_beat_s(seconds, probe_s) if probe_s > 0 else seconds
        start = anchor + timedelta(seconds=seconds + OFF_PROBE_BEAT[name] * beat)
        return interval(seconds, field, start)

    out: dict[str, BaseTrigger] = {
        TRAFFIC_FLUSH: off_beat(TRAFFIC_FLUSH, s.traffic_flush_interval_s,
                                "scheduler.traffic_flush_interval_s"),
        EVALUATE: interval(s.evaluate_interval_s, "scheduler.evaluate_interval_s"),
        DELIVERY: interval(s.delivery_interval_s, "scheduler.delivery_interval_s"),
        RETENTION: cron(s.retention_cron, "scheduler.retention_cron"),
        REPORT: cron(s.report_cron, "scheduler.report_cron"),
        SENSITIVITY: interval(settings.alerts.sensitivity_interval_s,
                              "alerts.sensitivity_interval_s"),
    }
    if s.memory_trim_interval_s > 0:  # 0 turns trimming off
        out[MEMORY_TRIM] = off_beat(MEMORY_TRIM, s.memory_trim_interval_s,
                                    "scheduler.memory_trim_interval_s")
    if s.probes_enabled:
        out[PROBE] = interval(s.probe_interval_s, "scheduler.probe_interval_s",
                              anchor + timedelta(seconds=probe_s))
        if s.burst_interval_s > 0:  # 0 turns burst probes off
            out[BURST] = off_beat(BURST, s.burst_interval_s, "scheduler.burst_interval_s")
    return out


def build_scheduler(
    settings: Settings,
    jobs: Mapping[str, Job],
    leader: LeaderLock,
    *,
    clock: Callable[[], datetime] = utcnow,
    metrics: JobMetrics | None = None,
) -> JobScheduler:
    """Return a JobScheduler (not started) with every given job that settings enable.

    The analysis jobs (SINGLETONS) run on threads of their own at nice `worker.nice`
    (monitor.priority); the measurement jobs keep the process's priority.
    """
    unknown = set(jobs) - set(EVERY_REPLICA) - set(SINGLETONS) - set(EVERY_PROCESS)
    if unknown:
        raise ValueError(f"jobs: unknown job {sorted(unknown)[0]!r}")
    trig = triggers(settings)
    aps = BackgroundScheduler(timezone=UTC, executors={
        "default": ThreadPoolExecutor(),
        ANALYSIS_EXECUTOR: analysis_executor(settings.worker.nice, len(SINGLETONS))})
    js = JobScheduler(aps, leader, clock, metrics)
    for name, fn in jobs.items():
        if name not in trig:
            log.info("job %s disabled by settings", name)
            continue
        singleton = name in SINGLETONS
        js.add(name, fn, trig[name], singleton=singleton,
               misfire_grace_s=settings.scheduler.misfire_grace_s,
               executor=ANALYSIS_EXECUTOR if singleton else "default")
    return js
