"""The one composition of a Prober: the service, `tailwatch probe --once` and tests use it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy.orm import Session, sessionmaker

from engine.protocol import Engine
from monitor.settings import Settings
from probes.canaries import CanarySuite
from probes.cycle import Observer
from probes.prober import Prober, prober_from_settings
from probes.reference import OutputChecker
from storage.writer import Writer


def build_prober(settings: Settings, engine: Engine, writer: Writer,
                 sessions: sessionmaker[Session], *,
                 observers: Sequence[Observer] = (),
                 suites: Mapping[str, CanarySuite] | None = None) -> Prober:
    """Return the Prober settings describe, checking outputs when `quality.enabled`."""
    quality = settings.quality
    checker = (OutputChecker(engine, sessions=sessions, writer=writer,
                             timeout_s=settings.probes.cycle_timeout_s,
                             store_text=quality.store_text)
               if quality.enabled else None)
    return prober_from_settings(settings.probes, engine, writer,
                                instance_id=settings.instance_id, observers=observers,
                                suites=suites, checker=checker)
