"""Python's cyclic garbage collector in a tailwatch process: the startup heap frozen, pauses timed.

A full collection walks every object the collector tracks while holding the GIL, so every
thread waits for it: each request in flight, the batching loop, the canaries. Once the
engine is warm the serving process tracks hundreds of thousands of objects (torch,
transformers, the compiled graphs, FastAPI, SQLAlchemy), nearly all alive until exit, and
a full collection walks them all each time the objects that outlived younger collections
add up to a quarter of them. `freeze` moves what is alive once warm into the permanent
generation, which collections skip; what is allocated later is tracked and collected as
before. `GcPauses` times every collection, so a pause is a series beside the latency it
caused instead of an unexplained outlier.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GENERATIONS = (0, 1, 2)
# Upper edges (seconds) of the pause histogram's buckets (GcSnapshot.buckets).
PAUSE_SECONDS_EDGES = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


_freeze_lock = threading.Lock()


def freeze() -> int:
    """Collect, then move every object alive now into the permanent generation, once per
    process (later calls change nothing); return how many objects are frozen."""
    with _freeze_lock:
        if gc.get_freeze_count() == 0:
            # Frozen garbage is never collected: collect first, so only live objects are
            # frozen. Once: what a process holds once its engine is warm is its startup
            # heap; a later freeze would keep whatever was alive then past its end.
            gc.collect()
            gc.freeze()
        return gc.get_freeze_count()


@dataclass(frozen=True)
class GcSnapshot:
    """The collector's pauses since `GcPauses.install`, by generation (0, 1, 2).

    count / seconds: collections and their total seconds; buckets: cumulative counts per
    PAUSE_SECONDS_EDGES edge (a Prometheus histogram's buckets); frozen: objects in the
    permanent generation (`freeze`), which no collection walks.
    """

    count: tuple[int, int, int]
    seconds: tuple[float, float, float]
    buckets: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    frozen: int


class GcPauses:
    """Time every collection of this process, by generation, from `gc.callbacks`.

    Example:
        pauses = GcPauses()
        pauses.install()     # once; a second call changes nothing
        pauses.snapshot()    # GcSnapshot(count=(1200, 109, 3), ...)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        # Reentrant: a collection may start (and call back here) while this same thread
        # holds the lock in snapshot().
        self._lock = threading.RLock()
        self._started: float | None = None
        self._count = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._buckets = [[0] * len(PAUSE_SECONDS_EDGES) for _ in GENERATIONS]

    def install(self) -> None:
        """Start timing collections (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        """Stop timing collections."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside every collection, young ones included: two clock reads and a few
        # adds, no allocation worth a collection of its own.
        if phase == "start":
            self._started = self._clock()
            return
        started, self._started = self._started, None
        if started is None:
            return  # installed during a collection: its start was not seen
        self.observe(int(info.get("generation", 2)), self._clock() - started)

    def observe(self, generation: int, seconds: float) -> None:
        """Count one collection of `generation` that paused the process `seconds`."""
        g = min(max(generation, 0), 2)
        first = bisect.bisect_left(PAUSE_SECONDS_EDGES, seconds)
        with self._lock:
            self._count[g] += 1
            self._seconds[g] += seconds
            buckets = self._buckets[g]
            for i in range(first, len(buckets)):
                buckets[i] += 1

    def snapshot(self) -> GcSnapshot:
        """Return the pauses so far and the frozen objects now."""
        with self._lock:
            return GcSnapshot(
                count=(self._count[0], self._count[1], self._count[2]),
                seconds=(self._seconds[0], self._seconds[1], self._seconds[2]),
                buckets=(tuple(self._buckets[0]), tuple(self._buckets[1]),
                         tuple(self._buckets[2])),
                frozen=gc.get_freeze_count())


# One per process: gc.callbacks is the process's, and every collector of it reads this.
PAUSES = GcPauses()
