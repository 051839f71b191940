"""A baseline refresh holds its window's cycles as machine numbers, not objects per cycle.

The worker refreshes every rolling baseline from the hour chunks of its window (7 days);
its peak stays in the process's RSS after the refresh ends (issue 38: the worker's RSS
stepped up at each hour boundary as the window filled).
"""

from __future__ import annotations

import random
import tracemalloc
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session, sessionmaker

from alerts.baselines import _cycle_values
from storage.queries import series as series_queries
from storage.queries.series import Chunk

T0 = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
HOURS, PER_HOUR = 24, 360  # a day of 10-s cycles
COHORT = ("m1", "c1")
# Four 8-byte columns a cycle, with room for the arrays' growth; a tuple of Python numbers
# per cycle (what the refresh held before) takes several times this.
BYTES_PER_CYCLE = 64


def _store(sm: sessionmaker[Session]) -> None:
    rng = random.Random(0)
    with sm.begin() as s:
        series_queries.add_chunks(s, [
            Chunk("p99", "bucket=64,source=canary", COHORT, T0 + timedelta(hours=h),
                  [[(T0 + timedelta(hours=h, seconds=10 * i)).timestamp(),
                    0.1 * (1 + rng.gauss(0, 0.02)), 4, 0.1] for i in range(PER_HOUR)])
            for h in range(HOURS)])


def test_a_days_chunks_are_read_into_columns(sessionmaker: sessionmaker[Session]) -> None:
    _store(sessionmaker)
    with sessionmaker() as s:
        chunks = series_queries.chunks(s, "p99", {"bucket=64,source=canary"}, {COHORT},
                                       T0, T0 + timedelta(hours=HOURS))
        tracemalloc.start()
        try:
            values = _cycle_values(chunks)
            held = tracemalloc.get_traced_memory()[0]  # what the refresh keeps reading on
        finally:
            tracemalloc.stop()
    col = values[("bucket=64,source=canary", COHORT)]
    assert len(col.values) == HOURS * PER_HOUR
    assert next(iter(col))[2:] == (4, 0.1)
    assert held < HOURS * PER_HOUR * BYTES_PER_CYCLE, held
