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
Those are floors: a rise must also stand `noise_factor` robust standard deviations
(1.4826 x the median absolute deviation, on the logs) above the trailing cycles' own
spread, the host-wide rise against the spread of the past cycles' host-wide rises, one
series' against its own. A fixed threshold fires on a noisy host's ordinary cycles: on a
contended two-core host with real traffic preempting the canaries, about 3 cycles in 10
read 15% slow, the arms ran in half the cycles and the real requests queued behind their
synthetic work. Scaled by the spread, the trigger fires on what this host's canaries do
not ordinarily do; a quiet host keeps the floor. And a rise must hold for `confirm`
consecutive cycles (of either kind): on that host a cycle's canaries rose 50-100% in one
cycle and were back the next (real requests arriving together, a burst, the worker's
evaluation on the same core), which no spread of 20 cycles prices in, while a slowdown
worth a page lasts several cycles (a rule confirms over several of its windows).
A slow cycle (the `confirm`-th in a row that rose) owes the arms to the `after` cycles
that follow it; every slow cycle renews the debt, so the arms run while the slowdown persists (until the trailing medians have
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

import math
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
    noise_factor: a rise must also exceed this many robust standard deviations of the
        trailing cycles (see the module docstring); 0: the fixed thresholds alone.
    confirm: consecutive cycles that rose make a slow one (1: every cycle that rose).
    after: cycles owed the arms after a slow one.
    """

    share: float = 0.25
    on_slowdown: float | None = 0.15
    history: int = 20
    min_history: int = 5
    bucket_factor: float = 3.0
    noise_factor: float = 3.0
    confirm: int = 2
    after: int = 1
    owed: int = 0  # cycles still owed the arms by the latest slow cycle
    rising: int = 0  # consecutive cycles, up to the latest, that rose over the thresholds
    # ran the arms (True) or not -> series -> that kind's trailing cycle medians
    _medians: dict[bool, dict[Series, deque[float]]] = field(
        default_factory=lambda: {True: {}, False: {}}, repr=False)
    # ran the arms or not -> that kind's past cycles' host-wide rises (log of the median
    # ratio over series), the spread the next host-wide rise is judged against
    _rises: dict[bool, deque[float]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"ab_share: must be in [0, 1], got {self.share}")
        if self.on_slowdown is not None and self.on_slowdown < 0:
            raise ValueError(f"ab_on_slowdown: must be >= 0 or null, got {self.on_slowdown}")
        if not 1 <= self.min_history <= self.history:
            raise ValueError(f"min_history: must be in [1, history], got {self.min_history}")
        if self.noise_factor < 0:
            raise ValueError(f"noise_factor: must be >= 0, got {self.noise_factor}")
        if self.confirm < 1:
            raise ValueError(f"confirm: must be >= 1, got {self.confirm}")
        self._rises = {True: deque(maxlen=self.history), False: deque(maxlen=self.history)}

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
        whether it ran the arms; return whether it was slow: the `confirm`-th cycle in a
        row that rose (`slow`), arms owed to the next.

        It is judged against, then taken into, the history of its own kind (`ab`) only.
        """
        if ab and self.owed > 0:
            self.owed -= 1
        slow = False
        if logs := self._rises_over_trailing(medians, ab=ab):
            # A cycle with too few of its own kind before it judges nothing and leaves the
            # run of rises as it was.
            self.rising = self.rising + 1 if self._rose(logs, ab=ab) else 0
            slow = self.rising >= self.confirm
            self._rises[ab].append(statistics.median(logs.values()))
        kind = self._medians[ab]
        for series, value in medians.items():
            kind.setdefault(series, deque(maxlen=self.history)).append(value)
        if slow:
            self.owed = self.after
        return slow

    def slow(self, medians: Mapping[Series, float], *, ab: bool) -> bool:
        """Return whether `medians` of a cycle that ran the arms (`ab`) or not rose over
        the trailing medians of cycles of that kind (not yet taken in) by more than the
        thresholds; `observe` calls a cycle slow after `confirm` such cycles in a row."""
        return self._rose(self._rises_over_trailing(medians, ab=ab), ab=ab)

    def _rose(self, logs: Mapping[Series, float], *, ab: bool) -> bool:
        """Return whether a cycle's rises over its kind's trailing medians
        (`_rises_over_trailing`) pass the thresholds (see `slow`)."""
        rise = self.on_slowdown
        if not self.enabled or not rise or not logs:
            return False
        host = statistics.median(logs.values())
        if host > max(math.log1p(rise), self._noise(self._rises[ab])):
            return True
        one = math.log1p(self.bucket_factor * rise)
        kind = self._medians[ab]
        return any(r > max(one, self._noise(math.log(v) for v in kind[series]))
                   for series, r in logs.items())

    def _rises_over_trailing(self, medians: Mapping[Series, float], *,
                             ab: bool) -> dict[Series, float]:
        """Return series -> the log of its value over its kind's trailing median, for the
        series with `min_history` cycles of that kind."""
        kind = self._medians[ab]
        return {series: math.log(value / statistics.median(past))
                for series, value in medians.items()
                if len(past := kind.get(series, ())) >= self.min_history}

    def _noise(self, values: Iterable[float]) -> float:
        """Return `noise_factor` robust standard deviations of `values` (logs); 0 while
        there are fewer than `min_history` of them."""
        xs = list(values)
        if len(xs) < self.min_history or not self.noise_factor:
            return 0.0
        mid = statistics.median(xs)
        return self.noise_factor * 1.4826 * statistics.median(abs(x - mid) for x in xs)
