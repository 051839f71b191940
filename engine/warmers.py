"""What the runtime warms besides the warm-up's own loop (engine.warmup): one bucket's
compiled calls on the rows' caches, and the compiled functions a request warms on first
use (the float target int8 serving defers, the compiled step beside the C step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine import group_encode
from engine.compile_watch import CompileWatch
from engine.graphs import GraphLedger
from engine.models import Models
from engine.protocol import RuntimeFlags
from engine.rows import Rows
from engine.runner import ModelRunner
from engine.warmup import Warmup

log = logging.getLogger(__name__)

Route = Callable[[int, RuntimeFlags], tuple[str, int, int | str | None]]


class BucketWarmer:
    """Warm one bucket's compiled calls (Warmup's `warm_bucket`, run on the owner thread)."""

    def __init__(self, models: Models, rows: Rows, ledger: GraphLedger, *, owned: bool,
                 cudagraphs_off: str | None, group_size: int = 0,
                 on_loop: group_encode.OnLoop | None = None) -> None:
        """`group_size`: the most arrivals of one bucket encoded in one call (below 2:
        each alone); `on_loop` runs a function on the batching loop's thread."""
        self.models = models
        self.group_size = group_size
        self._on_loop = on_loop
        self.rows = rows
        self.ledger = ledger
        self.owned = owned
        self.cudagraphs_off = cudagraphs_off
        self._rows_warm: set[int] = set()  # id() of runners whose fixed-row step is warm

    def __call__(self, edge: int, loaded: bool) -> str:
        """Warm bucket `edge` (on every row's caches in the CUDA-graph modes); return what it
        left. Warmup runs it on the owner thread; `loaded`: from the saved functions."""
        recorded = self.ledger.recorded()
        skips = cudagraph_skips()
        # Saved functions were called once as they loaded: enough unless graphs are to be
        # recorded on the rows (a warm CPU start so never imports dynamo to mark inputs).
        runners = self.models.warm_runners() if self.owned or not loaded else []
        for runner, verify in runners:
            name = "draft" if runner is self.models.draft else "target"
            # On the rows' own caches only where the owner thread serializes the warm-up
            # with the requests (a row decoding beside it would read the warm-up's writes).
            caches = [row[name] for row in self.rows.caches] if self.owned else []
            runner.warm(edge, verify=verify, caches=caches, mark=not loaded)
            if not loaded and runner is not self.models.draft and self._on_loop is not None:
                # Not from saved functions: a warm start compiles nothing (and so groups none).
                group_encode.warm(runner, edge, self.group_size, self._on_loop)
        # The fixed-row step's batch-size classes, once per runner (every bucket shares
        # them: the cross K/V is padded to the longest), whatever the saved functions.
        for runner, _verify in self.models.warm_runners():
            if runner is not self.models.draft and id(runner) not in self._rows_warm:
                runner.warm_rows(runner.compiled(edge), self.rows.buffers.get("target"))
                self._rows_warm.add(id(runner))
        if self.cudagraphs_off is not None:
            return f"no CUDA graphs: {self.cudagraphs_off}"
        skipped = cudagraph_skips() - skips
        if skipped:
            # The functions run, but as plain compiled code: the bucket is not what the
            # mode promises. Said as an error; the status and the metric carry it.
            raise RuntimeError(f"{skipped} graph(s) skipped by cudagraph trees "
                               "(TORCH_LOGS=cudagraphs says why)")
        return f"recorded {self.ledger.recorded() - recorded} CUDA graph(s)"


class FirstUseWarmer:
    """Warm, before a request takes a row, the compiled functions warm-up left to their
    first use; thread-safe (one compile at a time, each once)."""

    def __init__(self, models: Models, warmup: Warmup, watch: CompileWatch,
                 route: Route, rows: Rows | None = None) -> None:
        """`rows`: the decode rows, whose fixed-row buffers the compiled step's batched
        steps use (None: not warmed)."""
        self.models = models
        self._rows = rows
        self.warmup = warmup
        self._watch = watch
        self._route = route
        self._lock = threading.Lock()
        self._compiled_step_warm: set[int] = set()  # id() of runners: see compiled_step
        self._deferred_warm = False  # the deferred float target warmed: see deferred

    def deferred(self, n: int, flags: RuntimeFlags, runner: ModelRunner) -> float:
        """Warm the float target int8 serving left out of warm-up (Models.deferred) before
        its first compiled request takes a row; return the seconds it took (0.0: nothing).

        Before the admission slot, like the compiled step: a compile there would hold a
        decode row while other requests queue. A failure is counted and logged once; the
        request's own fallback then runs eager. `runner` is held by the caller.
        """
        if runner is not self.models.deferred or self._deferred_warm:
            return 0.0
        _path, _length, key = self._route(n, flags)
        if not isinstance(key, int):
            return 0.0  # eager, exact or overflow: nothing shared to warm
        started = time.perf_counter()
        with self._lock:
            if not self._deferred_warm:
                try:
                    self.warmup.warm_deferred(runner, key,
                                              verify=self.models.draft is not None)
                except Exception as exc:  # noqa: BLE001 - the request's own fallback runs eager
                    self._watch.record_failure()
                    log.error("engine: %s: its deferred warm-up failed: %s: %s",
                              runner.name, type(exc).__name__, str(exc)[:300])
                self._deferred_warm = True
        return time.perf_counter() - started

    def compiled_step(self, n: int, flags: RuntimeFlags, runner: ModelRunner) -> None:
        """Compile the compiled step beside the C step once per runner, before taking a row.

        The native_step flag off (the policy's fallback, the `compiled_step` A/B arm) runs
        it. Compiled inside the admission slot, its first call held the only decode row for
        the seconds a compile takes while real requests queued behind it; compiled here,
        with the length marked dynamic, one graph serves every bucket. Not at warm-up: a
        warm start from saved functions compiles nothing (the compiled step is not saved).
        Where rows are batched, its fixed-row step too: every batch-size class, on the
        rows' buffers, whose cross K/V buffers are allocated (and counted) then.
        `runner` (the target this request decodes with) is held by the caller.
        """
        draft = self.models.draft
        runners = [(runner, draft is not None)]
        if draft is not None:
            runners.append((draft, False))
        if all(id(r) in self._compiled_step_warm for r, _ in runners):
            return
        _path, _length, key = self._route(n, flags)
        if not isinstance(key, int):
            return  # eager, exact or overflow: no compiled step
        with self._lock:
            for r, verify in runners:
                if id(r) in self._compiled_step_warm:
                    continue
                try:
                    r.warm_compiled_step(key, verify=verify)
                    if r is not draft and r.native is not None and self._rows is not None:
                        # Its batched steps: the fixed-row step on buffers made for it now.
                        r.warm_rows(r.compiled_step(key), self._rows.fixed_rows())
                except Exception as exc:  # noqa: BLE001 - the request's own fallback runs eager
                    self._watch.record_failure()
                    log.error("engine: %s: the compiled step did not compile: %s: %s",
                              r.name, type(exc).__name__, str(exc)[:300])
                self._compiled_step_warm.add(id(r))


def cudagraph_skips() -> int:
    """Return the graphs cudagraph trees skipped so far (run without a CUDA graph)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0  # nothing compiled yet
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))
