"""Which canary cycles run the A/B arms: a random share, and on demand after a slow cycle.

An incident's probable cause (alerts.cause) compares the optimized arm with the
reference arms of the same cycles. With the arms drawn in a share of the cycles only
(`probes.ab_share`), a slowdown usually pages before any A/B cycle ran during it, and the
first page cannot tell host from optimization. So the serving process also watches its
own optimized canaries: a cycle that came out slow makes the next cycle run the arms,
whatever the draw says.

A cycle is slow when, against each series' trailing median (the last `history` cycle
medians of its optimized canaries, per bucket, path and decoding), either the median of
those ratios over its series rose by more than `on_slowdown` (host-wide), or one series
rose by more than `bucket_factor` times that (one bucket: a single bucket's cycle median
is noisier than the median over buckets). A slow cycle owes the arms to the `after`
cycles that follow it; every slow cycle renews the debt, so the arms run while the
slowdown persists (until the trailing medians have taken the new level in, about
`history / 2` cycles) and `after` cycles more. The random draw stays the background
schedule and is drawn every cycle, owed or not, so the drawn schedule does not depend on
slowdowns. With a share of 0 no arm runs at all: the cause reads a reference arm's change
against the drawn arms of the hour before, which would not exist. Nothing is read from the
database: the decision is the process's own.

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

# Why a cycle ran its arms (CycleResult.ab_reason); "" when it ran none.
AB_DRAWN = "drawn"  # the background draw (probes.ab_share)
AB_SLOWDOWN = "slowdown"  # on demand: the previous cycle's optimized canaries were slow
AB_REQUESTED = "requested"  # the caller asked for them (ProbeCycle.run(ab=True))

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
    history: trailing cycle medians kept per series; min_history: fewer judge nothing.
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
    _medians: dict[Series, deque[float]] = field(default_factory=dict, repr=False)

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
        """Return why the next cycle runs its arms (AB_DRAWN, AB_SLOWDOWN) or None.

        Draws from `rng` exactly once per call, whether or not arms are owed.
        """
        drawn = rng.random() < self.share
        if drawn:
            return AB_DRAWN
        return AB_SLOWDOWN if self.owed > 0 else None

    def observe(self, medians: Mapping[Series, float], *, ab: bool) -> bool:
        """Take in a finished cycle: its optimized medians (`optimized_medians`) and
        whether it ran the arms; return whether it was slow (arms owed to the next)."""
        if ab and self.owed > 0:
            self.owed -= 1
        slow = self.enabled and self.slow(medians)
        for series, value in medians.items():
            self._medians.setdefault(series, deque(maxlen=self.history)).append(value)
        if slow:
            self.owed = self.after
        return slow

    def slow(self, medians: Mapping[Series, float]) -> bool:
        """Return whether `medians` rose over the trailing medians (not yet taken in)."""
        rise = self.on_slowdown
        if not self.enabled or not rise:
            return False
        ratios = [value / statistics.median(past) for series, value in medians.items()
                  if len(past := self._medians.get(series, ())) >= self.min_history]
        if not ratios:
            return False
        host = statistics.median(ratios) - 1.0 > rise
        one = max(ratios) - 1.0 > self.bucket_factor * rise
        return host or one
