"""Which canary cycles run the A/B arms: a random share, and on demand after a slow cycle.

An incident's probable cause (alerts.cause) compares the optimized arm with the
reference arms of the same cycles. With the arms drawn in a share of the cycles only
(`probes.ab_share`), a slowdown usually pages before any A/B cycle ran during it, and the
first page cannot tell host from optimization. So the serving process also watches its
own optimized canaries: a cycle that came out slow makes the next cycle run the arms,
whatever the draw says.

A cycle is slow when, against each series' trailing median (the last `history` cycle
medians of its optimized canaries, per bucket, path and decoding, in cycles of its own
kind), either the median of those ratios over its series rose by more than
`on_slowdown` (host-wide), or one series rose by more than `bucket_factor` times that
(one bucket: a single bucket's cycle median is noisier than the median over buckets).
A slow cycle owes the arms to the `after` cycles that follow it; every slow cycle renews
the debt, so the arms run while the slowdown persists (until the trailing medians have
taken the new level in, about `history / 2` cycles of that kind) and `after` cycles
more. The random draw stays the background schedule and is drawn every cycle, owed or
not, so the drawn schedule does not depend on slowdowns. With a share of 0 no arm runs
at all: the cause reads a reference arm's change against the drawn arms of the hour
before, which would not exist. Nothing is read from the database: the decision is the
process's own.

The trailing medians are kept apart per cycle kind, cycles that ran the arms and cycles
that did not, and a cycle is judged against its own kind's only (`min_history` cycles of
that kind at least). An A/B cycle runs each optimized canary back to back with its
reference arms (probes.cycle), so its optimized medians can sit at another level than a
plain cycle's (whatever the arms' calls leave behind lands on the optimized ones);
judged against plain cycles, an A/B cycle could come out "slow" for having run the arms
and owe them to the next cycle: the monitor measuring itself (and, where A/B cycles are
the faster kind, a plain cycle judged against them likewise). The cost: an A/B history
fills at the A/B rate, so for a process's first `min_history` A/B cycles (about
`min_history / share` cycles) an A/B cycle judges nothing; a slowdown then still brings
the arms, from the plain cycles in between.

Example:
    schedule = AbSchedule(share=0.25, on_slowdown=0.15)
    reason = schedule.due(rng)            # "drawn", "slowdown" or None: run the arms?
    ...                                   # run the cycle
    schedule.observe(optimized_medians(result.groups), ab=reason is not None)
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from probes.measure import VARIANT_DEFAULT, GroupResult
from vocab import AbReason

Series = tuple[str, str, str]  # (bucket, path, decoding) of the optimized canaries


def optimized_medians(groups: Iterable[GroupResult]) -> dict[Series, float]:
    """Return (bucket, path, decoding) -> the median latency of a cycle's optimized canaries."""
    return {(g.bucket, g.path, g.decoding): g.latency.p50 for g in groups
            if g.variant == VARIANT_DEFAULT and g.latency.p50 is not None
            and g.latency.p50 > 0}


@dataclass
class AbSchedule:
    """Decide per cycle whether the A/B arms run (see the module docstring).

    share: the background share of cycles drawn (probes.ab_share).
    on_slowdown: the rise over the trailing median that makes a cycle slow
        (probes.ab_on_slowdown); 0 or None: arms on the draw only.
    history: trailing cycle medians kept per series and cycle kind (ran the arms or
        not); min_history: fewer of a cycle's own kind judge nothing.
    bucket_factor: one series alone must rise this many times `on_slowdown`.
    after: cycles owed the arms after a slow one.
    """

    share: float = 0.25
    on_slowdown: float | None = 0.15
    history: int = 20
    min_history: int = 5
    bucket_factor: float = 3.0
    after: int = 1
    owed: int = 0  # cycles still owed the arms by the latest slow cycle
    # ran the arms (True) or not -> series -> that kind's trailing cycle medians
    _medians: dict[bool, dict[Series, deque[float]]] = field(
        default_factory=lambda: {True: {}, False: {}}, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"ab_share: must be in [0, 1], got {self.share}")
        if self.on_slowdown is not None and self.on_slowdown < 0:
            raise ValueError(f"ab_on_slowdown: must be >= 0 or null, got {self.on_slowdown}")
        if not 1 <= self.min_history <= self.history:
            raise ValueError(f"min_history: must be in [1, history], got {self.min_history}")

    @property
    def enabled(self) -> bool:
        """Return whether slow cycles bring the arms on demand: not with a share of 0 (no
        arms at all; nor would the cause have drawn arms before the slowdown to compare)."""
        return bool(self.on_slowdown) and self.share > 0

    def due(self, rng: random.Random) -> str | None:
        """Return why the next cycle runs its arms (vocab.AbReason: DRAWN, SLOWDOWN) or None.

        Draws from `rng` exactly once per call, whether or not arms are owed.
        """
        drawn = rng.random() < self.share
        if drawn:
            return AbReason.DRAWN
        return AbReason.SLOWDOWN if self.owed > 0 else None

    def observe(self, medians: Mapping[Series, float], *, ab: bool) -> bool:
        """Take in a finished cycle: its optimized medians (`optimized_medians`) and
        whether it ran the arms; return whether it was slow (arms owed to the next).

        It is judged against, then taken into, the history of its own kind (`ab`) only.
        """
        if ab and self.owed > 0:
            self.owed -= 1
        slow = self.enabled and self.slow(medians, ab=ab)
        kind = self._medians[ab]
        for series, value in medians.items():
            kind.setdefault(series, deque(maxlen=self.history)).append(value)
        if slow:
            self.owed = self.after
        return slow

    def slow(self, medians: Mapping[Series, float], *, ab: bool) -> bool:
        """Return whether `medians` of a cycle that ran the arms (`ab`) or not rose over
        the trailing medians of cycles of that kind (not yet taken in)."""
        rise = self.on_slowdown
        if not self.enabled or not rise:
            return False
        kind = self._medians[ab]
        ratios = [value / statistics.median(past) for series, value in medians.items()
                  if len(past := kind.get(series, ())) >= self.min_history]
        if not ratios:
            return False
        host = statistics.median(ratios) - 1.0 > rise
        one = max(ratios) - 1.0 > self.bucket_factor * rise
        return host or one
