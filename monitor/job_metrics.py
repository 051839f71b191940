"""The monitor's own cost: how long each scheduled job ran, when it last succeeded, failures.

Registered by whoever runs a scheduler (the serving process, `tailwatch worker`) on its own
registry: a process without jobs exports no job series. The label is `scheduled_job`, not
`job`: Prometheus owns `job` (the scrape job) and would rename ours to `exported_job`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "tailwatch"
LABEL = "scheduled_job"
# A traffic flush takes milliseconds, an evaluation on weeks of history seconds, a weekly
# report minutes: 1 ms .. 10 min.
JOB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0, 60.0, 120.0, 300.0, 600.0)


class JobMetrics:
    """Job duration histogram, last-success timestamp and failures, labelled by job.

    Example:
        jm = JobMetrics(registry)
        jm.track("evaluate")
        jm.observe("evaluate", 0.42, ok=True, finished_at=time.time())
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.duration = Histogram(
            f"{PREFIX}_job_duration_seconds",
            "Wall time of one scheduled job run (failed runs included).",
            (LABEL,), buckets=JOB_BUCKETS, registry=registry)
        self.last_success = Gauge(
            f"{PREFIX}_job_last_success_timestamp_seconds",
            "Unix time the job's latest successful run finished.", (LABEL,), registry=registry)
        self.failures = Counter(
            f"{PREFIX}_job_failures", "Scheduled job runs that raised, by job.", (LABEL,),
            registry=registry)

    def track(self, job: str) -> None:
        """Create the job's series at zero (a job that never ran still shows)."""
        self.duration.labels(job)
        self.failures.labels(job)

    def observe(self, job: str, duration_s: float, *, ok: bool, finished_at: float) -> None:
        """Record one finished run of `job`."""
        self.duration.labels(job).observe(duration_s)
        if ok:
            self.last_success.labels(job).set(finished_at)
        else:
            self.failures.labels(job).inc()

    def unregister(self) -> None:
        """Remove the series from the registry (a stopped scheduler's jobs no longer run)."""
        for metric in (self.duration, self.last_success, self.failures):
            self.registry.unregister(metric)
