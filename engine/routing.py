"""A request's route: the path and padded length its input runs at, the compiled
functions it uses, whether it speculates, and with which target weights.

The flags are read once per request (engine.flags.GuardedFlags) and everything here is
decided from them, so a flag flip takes effect on the next request.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.buckets import bucket_edge
from engine.cancel import CancelSignal
from engine.models import Models
from engine.protocol import (
    PATH_COMPILED,
    PATH_EAGER,
    PATH_EXACT,
    PATH_OVERFLOW,
    RuntimeFlags,
)
from engine.runner import ModelRunner

EXACT = "exact"


@dataclass(frozen=True)
class Plan:
    """What one request will run, decided before it waits for a row.

    k: draft tokens per round (0: direct). probation: it speculates although its bucket's
    flag is off (recovery sampling). deadline: perf_counter time it must finish by (None:
    no timeout). cancel: set by its caller to stop it, checked where the deadline is
    (None: never cancelled).
    """

    ids: list[int]
    label: str
    flags: RuntimeFlags
    max_new: int
    k: int
    probation: bool
    quantized: bool
    native: bool
    runner: ModelRunner  # the target it decodes with (int8 or float)
    deadline: float | None
    cancel: CancelSignal | None = None

    @property
    def n(self) -> int:
        """Return its input tokens."""
        return len(self.ids)


class Router:
    """Route requests to a path and draw the probation share; thread-safe."""

    def __init__(self, models: Models, buckets: tuple[int, ...], *, compile_on: bool,
                 is_warm: Callable[[int], bool]) -> None:
        self.models = models
        self.buckets = buckets
        self.compile_on = compile_on
        self.is_warm = is_warm
        self._lock = threading.Lock()
        self._rng = random.Random(0)

    def route(self, n: int, flags: RuntimeFlags) -> tuple[str, int, int | str | None]:
        """Return (path, padded length, compiled-function key or None for eager)."""
        edge = bucket_edge(n, self.buckets)
        if edge is None:
            return PATH_OVERFLOW, n, None
        compiled = flags.compiled and self.compile_on
        if not flags.bucketing:
            return (PATH_EXACT, n, EXACT) if compiled else (PATH_EAGER, n, None)
        if compiled and self.is_warm(edge):
            return PATH_COMPILED, edge, edge
        return PATH_EAGER, edge, None

    def speculate(self, flags: RuntimeFlags, label: str) -> tuple[bool, bool]:
        """Return (whether a request in bucket `label` speculates, whether on probation)."""
        if self.models.draft is None:
            return False, False
        if flags.speculative_for(label):
            return True, False
        share = flags.probation_for(label)
        if share > 0:
            with self._lock:
                draw = self._rng.random()
            if draw < share:
                return True, True
        return False, False

    def on_native(self, key: int | str | None, quantized: bool, native: bool) -> bool:
        """Return whether a request routed to `key` decodes its target with the C step."""
        models = self.models
        target = models.target_q if quantized and models.target_q is not None \
            else models.target
        return key is not None and native and target.native is not None
