"""Choose the speculative draft length k per bucket from measured acceptance and costs.

Pure Python (no torch). With a per-token acceptance probability a, a round that
proposes k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
k * draft_step + verify seconds; direct decoding costs one target step per token.
The chosen k maximizes E(k) / cost(k); when even the best k emits fewer tokens per
second than direct decoding, the bucket falls back to direct decoding (k = 0), and
a few requests still speculate so a recovery is seen: the first after `probe_every`
requests, then the gap doubles after each probe that confirms the fallback (up to
`max_probe_every`), since on a fast direct path a failing speculative request costs
several direct ones; it resets once speculation pays again. The choice only
changes speed: every k gives the target's own greedy output.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.protocol import SpecStats


@dataclass(frozen=True)
class DraftLengthView:
    """One bucket's measured acceptance, costs and chosen k (0 = direct fallback)."""

    k: int
    acceptance: float | None  # per-token acceptance probability estimate
    draft_step_s: float | None
    verify_s: float | None
    target_step_s: float | None
    expected_speedup: float | None  # best k's tokens/s over direct tokens/s
    fallback: bool


class _Bucket:
    def __init__(self) -> None:
        self.accepted = 0.0
        self.trials = 0.0
        self.draft_s: float | None = None
        self.verify_s: float | None = None
        self.step_s: float | None = None
        self.requests = 0
        self.probe_gap = 0  # requests between fallback probes now (0: not falling back)
        self.since_probe = 0


def expected_tokens(a: float, k: int) -> float:
    """Return the tokens one round emits on average: accepted prefix plus the target's own."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class DraftLength:
    """Per-bucket k from acceptance counters and measured costs; thread-safe.

    Acceptance counters decay by half every `half_life` proposals (not per request: one
    long request carries as much evidence as many short ones), so the choice follows a
    drift within a request or two; costs decay by `decay` per request. `margin` keeps a
    bucket speculating only when it expects to be faster than direct by that factor.
    """

    def __init__(self, *, k_max: int, k_initial: int, decay: float = 0.9,
                 half_life: float = 64.0, probe_every: int = 16, max_probe_every: int = 256,
                 margin: float = 1.05,
                 min_trials: float = 8.0) -> None:
        if not 1 <= k_initial <= k_max:
            raise ValueError(f"speculative_k: must be between 1 and {k_max}, got {k_initial}")
        self.k_max = k_max
        self.k_initial = k_initial
        self._decay = decay
        self._half_life = half_life
        self._probe_every = probe_every
        self._max_probe_every = max(max_probe_every, probe_every)
        self._margin = margin
        self._min_trials = min_trials
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else self._decay * old + (1 - self._decay) * new

    def record_speculative(self, bucket: str, spec: SpecStats, *, draft_steps: int,
                           draft_s: float, verifies: int, verify_s: float) -> None:
        """Fold one speculative request's acceptance counters and round costs in."""
        if spec.drafts <= 0:
            return
        per = spec.accepted_per_position
        # A proposal is a trial only if every earlier one in its round was accepted.
        trials = spec.drafts + sum(per[:-1])
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            keep = 0.5 ** (trials / self._half_life)
            b.accepted = keep * b.accepted + spec.accepted_tokens
            b.trials = keep * b.trials + trials
            if draft_steps:
                b.draft_s = self._ewma(b.draft_s, draft_s / draft_steps)
            if verifies:
                b.verify_s = self._ewma(b.verify_s, verify_s / verifies)

    def record_direct(self, bucket: str, tokens: int, decode_s: float) -> None:
        """Fold one direct request's decode time per token in."""
        if tokens <= 0:
            return
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            b.step_s = self._ewma(b.step_s, decode_s / tokens)

    def _best(self, b: _Bucket) -> tuple[int, float | None, float | None]:
        """Return (k, acceptance, expected speedup) for a bucket's current measurements."""
        if b.trials < self._min_trials or b.draft_s is None or b.verify_s is None:
            return self.k_initial, None, None
        a = min(b.accepted / b.trials, 1.0)
        best_k, best_rate = 1, 0.0
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(a, k) / (k * b.draft_s + b.verify_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        speedup = best_rate * b.step_s if b.step_s else None
        return best_k, a, speedup

    def choose(self, bucket: str, *, fallback: bool = True) -> int:
        """Return k for the next speculative request in `bucket` (0: run it direct).

        fallback=False always returns a k >= 1 (speculation asked for explicitly).
        """
        with self._lock:
            b = self._buckets.setdefault(bucket, _Bucket())
            b.requests += 1
            k, _, speedup = self._best(b)
            if fallback and speedup is not None and speedup < self._margin:
                # Keep measuring acceptance on a few requests so a recovery is noticed.
                b.probe_gap = b.probe_gap or self._probe_every
                b.since_probe += 1
                if b.since_probe < b.probe_gap:
                    return 0
                b.since_probe = 0
                b.probe_gap = min(2 * b.probe_gap, self._max_probe_every)
                return k
            b.probe_gap = b.since_probe = 0
            return k

    def view(self) -> dict[str, DraftLengthView]:
        """Return every bucket's measurements and choice."""
        with self._lock:
            out = {}
            for label, b in self._buckets.items():
                k, a, speedup = self._best(b)
                fallback = speedup is not None and speedup < self._margin
                out[label] = DraftLengthView(k=0 if fallback else k, acceptance=a,
                                             draft_step_s=b.draft_s, verify_s=b.verify_s,
                                             target_step_s=b.step_s,
                                             expected_speedup=speedup, fallback=fallback)
            return out
