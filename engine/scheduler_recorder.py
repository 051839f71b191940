"""What the batching loop records: step seconds by phase, and each request's batch sizes.

The loop (engine.scheduler) hands every arrival and every step to its recorder; the
engine's BatchSnapshot (step counts and seconds by phase) and a request's batching fields
(GenerateResult.batch_join_step, batch_size_mean) are read from what it recorded. The
loop's own decisions never read a recorder, so `NullRecorder`, which records nothing,
changes no output: bench.instrumentation swaps it in to measure what recording costs.

    recorder = StepRecorder()
    recorder.joined(job, encode_s)           # a request's encoder ran; it joins now
    recorder.stepped("decode", seconds, jobs)  # one step over these requests' rows
    steps, count, seconds_sum, buckets = recorder.totals()
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.protocol import STEP_SECONDS_EDGES

PHASE_ENCODE, PHASE_DECODE, PHASE_VERIFY = "encode", "decode", "verify"
PHASES = (PHASE_ENCODE, PHASE_DECODE, PHASE_VERIFY)
Totals = tuple[int, dict[str, int], dict[str, float], dict[str, tuple[int, ...]]]


class Recorded(Protocol):
    """The fields of a request (engine.scheduler.Job) a recorder fills in."""

    joined_step: int
    steps: int
    batch_sum: int


@dataclass
class _Phase:
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_SECONDS_EDGES))

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, edge in enumerate(STEP_SECONDS_EDGES):
            if seconds <= edge:
                self.buckets[i] += 1


class StepRecorder:
    """Record the loop's steps: counts and seconds by phase, and per request the step it
    joined at, the steps it took part in and the rows in them (what production runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a snapshot reads from another thread
        self._steps = 0
        self._phases = {p: _Phase() for p in PHASES}

    def joined(self, job: Recorded, encode_s: float) -> None:
        """Record an arrival whose encoder took `encode_s`; it joins at the next step."""
        with self._lock:
            self._phases[PHASE_ENCODE].observe(encode_s)
            job.joined_step = self._steps

    def stepped(self, phase: str, seconds: float, jobs: Sequence[Recorded]) -> None:
        """Record one step of `phase` that took `seconds` over `jobs`' rows."""
        with self._lock:
            self._phases[phase].observe(seconds)
            self._steps += 1
        b = len(jobs)
        for job in jobs:
            job.steps += 1
            job.batch_sum += b

    def totals(self) -> Totals:
        """Return (steps, count, seconds summed, cumulative buckets by phase) since start."""
        with self._lock:
            return (self._steps, {p: v.count for p, v in self._phases.items()},
                    {p: v.total for p, v in self._phases.items()},
                    {p: tuple(v.buckets) for p, v in self._phases.items()})


class NullRecorder(StepRecorder):
    """Record nothing: the loop without its instrumentation (bench.instrumentation)."""

    def joined(self, job: Recorded, encode_s: float) -> None:
        """Record nothing."""

    def stepped(self, phase: str, seconds: float, jobs: Sequence[Recorded]) -> None:
        """Record nothing."""
