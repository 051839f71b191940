"""Background jobs on APScheduler 3.x: probes on every replica, singletons on the leader.

Jobs (names are the keys of the `jobs` mapping given to `build_scheduler`):
    probe, burst, traffic_flush          every replica (rows carry instance_id)
    evaluate, delivery, retention, report  only on the replica holding the leader lock
A job whose callable is not given is not scheduled. Every job runs with
max_instances=1 and coalesce=True, so a slow run is never overlapped by its next
trigger and a backlog of missed triggers runs once; misfire_grace_time from settings.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from monitor.leader import LeaderLock
from storage.errors import DatabaseUnavailable
from vocab import utcnow

if TYPE_CHECKING:
    from monitor.settings import Settings

log = logging.getLogger(__name__)

PROBE = "probe"
BURST = "burst"
TRAFFIC_FLUSH = "traffic_flush"
EVALUATE = "evaluate"
DELIVERY = "delivery"
RETENTION = "retention"
REPORT = "report"
EVERY_REPLICA = (PROBE, BURST, TRAFFIC_FLUSH)
SINGLETONS = (EVALUATE, DELIVERY, RETENTION, REPORT)

Job = Callable[[], object]


@dataclass(frozen=True)
class JobStats:
    """How one job has fared since start-up."""

    name: str
    singleton: bool
    runs: int = 0
    failures: int = 0
    not_leader: int = 0  # triggers skipped because another replica leads
    running: bool = False
    last_started_at: datetime | None = None
    last_finished_at: datetime | None = None
    last_error: str | None = None


class JobScheduler:
    """A BackgroundScheduler with the leader lock and per-job stats."""

    def __init__(self, aps: BackgroundScheduler, leader: LeaderLock,
                 clock: Callable[[], datetime]) -> None:
        self.aps = aps
        self.leader = leader
        self.clock = clock
        self._stats: dict[str, JobStats] = {}
        self._lock = threading.Lock()

    def add(self, name: str, fn: Job, trigger: BaseTrigger, *, singleton: bool,
            misfire_grace_s: int) -> None:
        """Schedule `fn` under `name` (singletons only run while this replica leads)."""
        with self._lock:
            self._stats[name] = JobStats(name, singleton)
        self.aps.add_job(self._wrap(name, fn, singleton), trigger, id=name, name=name,
                         max_instances=1, coalesce=True, misfire_grace_time=misfire_grace_s,
                         replace_existing=True)

    def _update(self, name: str, **changes: Any) -> None:
        with self._lock:
            self._stats[name] = replace(self._stats[name], **changes)

    def _wrap(self, name: str, fn: Job, singleton: bool) -> Callable[[], None]:
        streak = [0]  # consecutive failed runs
        kinds: set[str] = set()  # failures already logged in this streak

        def run() -> None:
            if singleton and not self.leader.is_leader():
                with self._lock:
                    s = self._stats[name]
                    self._stats[name] = replace(s, not_leader=s.not_leader + 1)
                return
            self._update(name, running=True, last_started_at=self.clock())
            try:
                result = fn()
            except Exception as exc:
                with self._lock:
                    s = self._stats[name]
                    streak[0] += 1
                    self._stats[name] = replace(
                        s, failures=s.failures + 1, last_error=f"{type(exc).__name__}: {exc}")
                _log_failure(name, exc, streak, kinds)
            else:
                if streak[0]:
                    log.info("scheduled job %s: recovered after %d failed run(s)", name,
                             streak[0])
                streak[0] = 0
                kinds.clear()
                _log_outcome(name, result)
            finally:
                with self._lock:
                    s = self._stats[name]
                    self._stats[name] = replace(s, runs=s.runs + 1, running=False,
                                                last_finished_at=self.clock())

        run.__name__ = f"job_{name}"
        return run

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


def interval(seconds: float, field: str) -> IntervalTrigger:
    """Return an IntervalTrigger; ValueError names the field."""
    if seconds <= 0:
        raise ValueError(f"{field}: must be > 0 seconds, got {seconds}")
    return IntervalTrigger(seconds=seconds, timezone=UTC)


def triggers(settings: Settings) -> dict[str, BaseTrigger]:
    """Return each job's trigger from settings (probe jobs left out when disabled)."""
    s = settings.scheduler
    out: dict[str, BaseTrigger] = {
        TRAFFIC_FLUSH: interval(s.traffic_flush_interval_s, "scheduler.traffic_flush_interval_s"),
        EVALUATE: interval(s.evaluate_interval_s, "scheduler.evaluate_interval_s"),
        DELIVERY: interval(s.delivery_interval_s, "scheduler.delivery_interval_s"),
        RETENTION: cron(s.retention_cron, "scheduler.retention_cron"),
        REPORT: cron(s.report_cron, "scheduler.report_cron"),
    }
    if s.probes_enabled:
        out[PROBE] = interval(s.probe_interval_s, "scheduler.probe_interval_s")
        if s.burst_interval_s > 0:  # 0 turns burst probes off
            out[BURST] = interval(s.burst_interval_s, "scheduler.burst_interval_s")
    return out


def build_scheduler(
    settings: Settings,
    jobs: Mapping[str, Job],
    leader: LeaderLock,
    *,
    clock: Callable[[], datetime] = utcnow,
) -> JobScheduler:
    """Return a JobScheduler (not started) with every given job that settings enable."""
    unknown = set(jobs) - set(EVERY_REPLICA) - set(SINGLETONS)
    if unknown:
        raise ValueError(f"jobs: unknown job {sorted(unknown)[0]!r}")
    trig = triggers(settings)
    aps = BackgroundScheduler(timezone=UTC)
    js = JobScheduler(aps, leader, clock)
    for name, fn in jobs.items():
        if name not in trig:
            log.info("job %s disabled by settings", name)
            continue
        js.add(name, fn, trig[name], singleton=name in SINGLETONS,
               misfire_grace_s=settings.scheduler.misfire_grace_s)
    return js
