"""The one composition of a Prober: the service, `tailwatch probe --once` and tests use it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import Engine
from monitor.settings import Settings
from probes.canaries import CanarySuite
from probes.cycle import JobActivity, Observer
from probes.prober import Prober, prober_from_settings
from probes.reference import OutputChecker
from storage.writer import Writer

if TYPE_CHECKING:
    from monitor.scheduler import JobScheduler

# The jobs whose runs are the probes themselves. ProbeRunner runs one probe at a time, so
# while a cycle or a burst measures, its own job is running and the other's, if running,
# only waits for it: neither shares the machine with the measurement.
PROBE_JOB = "probe"
BURST_JOB = "burst"


class SchedulerActivity:
    """Report this process's scheduled jobs to a prober, less the probe jobs themselves.

    The scheduler starts after the prober is composed, so it is attached later; until
    then no job runs here and the activity is empty.
    """

    def __init__(self) -> None:
        self.scheduler: JobScheduler | None = None

    def __call__(self) -> Mapping[str, tuple[int, bool]]:
        """Return job name -> (runs started so far, running now)."""
        scheduler = self.scheduler
        if scheduler is None:
            return {}
        return {name: v for name, v in scheduler.activity().items()
                if name not in (PROBE_JOB, BURST_JOB)}


def build_prober(settings: Settings, engine: Engine, writer: Writer,
                 sessions: sessionmaker[Session], *,
                 observers: Sequence[Observer] = (),
                 suites: Mapping[str, CanarySuite] | None = None,
                 activity: JobActivity | None = None) -> Prober:
    """Return the Prober settings describe, checking outputs when `quality.enabled`."""
    quality = settings.quality
    checker = (OutputChecker(engine, sessions=sessions, writer=writer,
                             timeout_s=settings.probes.cycle_timeout_s,
                             store_text=quality.store_text)
               if quality.enabled else None)
    return prober_from_settings(settings.probes, engine, writer,
                                instance_id=settings.instance_id, observers=observers,
                                suites=suites, checker=checker, activity=activity)
