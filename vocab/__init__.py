"""The shared vocabulary: enumerated values every package speaks, and the clock.

A leaf module with no dependencies, so `engine`, `storage`, `probes`, `alerts` and
`monitor` all import it without breaking the one-way import rules. Members are
`StrEnum`s: they compare equal to their string values, which are what SQL stores.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum


class Path(StrEnum):
    """How a request's input shapes ran."""

    COMPILED = "compiled"  # bucketed static shapes, compiled graphs
    EXACT = "exact"  # bucketing off: exact input shape, compiled (may recompile)
    EAGER = "eager"  # compile off (fallback) or bucket not warm yet
    OVERFLOW = "overflow"  # longer than the largest bucket: always eager, counted


class Decoding(StrEnum):
    """How output tokens were chosen."""

    DIRECT = "direct"
    SPECULATIVE = "speculative"


class Variant(StrEnum):
    """Which arm of a probe cycle produced a result.

    OPTIMIZED runs with the engine's current flags; the A/B arms turn one optimization
    off (EAGER, DIRECT, EXACT) or, while its fallback is on, back on (SPECULATIVE, COMPILED).
    """

    OPTIMIZED = "optimized"
    EAGER = "eager"
    DIRECT = "direct"
    EXACT = "exact"
    SPECULATIVE = "speculative"
    COMPILED = "compiled"
    FLOAT32 = "float32"  # int8 weights off (the quantized flag is on)
    QUANTIZED = "quantized"  # int8 weights back on while the quantized flag is off
    COMPILED_STEP = "compiled_step"  # the C decode step off (the compiled step serves)
    NATIVE_STEP = "native_step"  # the C decode step back on while the native_step flag is off
    UNBATCHED = "unbatched"  # the burst probe's arm with batching off (every request alone)
    REFERENCE = "reference"  # eager, float32, direct, exact shape: what outputs must match


class AbReason(StrEnum):
    """Why a probe cycle ran its A/B arms (probes.ab_schedule; details["ab_reason"])."""

    DRAWN = "drawn"  # the background draw (probes.ab_share)
    SLOWDOWN = "slowdown"  # on demand: the previous cycle's optimized canaries were slow
    REQUESTED = "requested"  # a caller asked for them (ProbeCycle.run(ab=True))


class RunStatus(StrEnum):
    """How a probe run ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


class RunKind(StrEnum):
    """What a probe run measured."""

    CYCLE = "cycle"
    BURST = "burst"
    AB = "ab"


class Source(StrEnum):
    """Where a measurement came from."""

    CANARY = "canary"  # fixed canary probes
    TRAFFIC = "traffic"  # real requests through /v1/generate
    BURST = "burst"  # the burst probe


BUCKET_OVERFLOW = "overflow"  # the bucket label of inputs longer than the largest bucket
SCOPE_GLOBAL = "global"  # a flag that applies to every bucket


def utcnow() -> datetime:
    """Return the current time, timezone-aware UTC."""
    return datetime.now(UTC)
