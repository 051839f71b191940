"""Admission control: bounded decode streams, a bounded wait queue, real traffic first.

The queue is bounded twice: at most `max_queue` callers wait, and (`max_queue_tokens` > 0)
the tokens they carry stay within a budget. A caller's tokens are its input tokens plus
the new tokens it may ask for (`slot(..., tokens=)`: what its row will decode, its worst
case), so the budget bounds the work queued ahead of the next arrival, which a count of
callers does not when their lengths differ a hundredfold. Only waiting callers count: a
caller that finds a free slot never queues.

Callers are real (user requests) or synthetic (canaries, bursts, reference replays: the
engine's `canary=True`). Synthetic load is shed first, so a probe never makes a user wait
behind it or get refused because of it:

- a freed slot goes to the oldest waiting real caller; synthetic callers get one only
  when no real caller waits;
- a synthetic caller does not queue while a real caller waits: it is refused at once
  (Overloaded, reason "real_waiting");
- a real caller that finds the queue full takes the place of the newest waiting
  synthetic caller, which leaves with Overloaded (reason "shed"); only a queue holding
  nothing but real callers refuses a real one (reason "queue_full");
- the same for tokens: a real caller that would take the queued tokens past the budget
  sheds the newest synthetic callers until it fits, and is refused (reason
  "token_budget") only when the real callers' tokens alone leave it no room (and then
  sheds none for nothing).

A real caller never waits for a queued synthetic one, and (`preempt=True`) not for a
running one either:

- a real caller that would wait while at least one slot is held by a synthetic caller
  gets the reserved extra slot (index `max_concurrency`) at once (counted in
  `preemptions`). Only real callers take it, one at a time: while it is held further
  real callers queue as above, first for any freed slot; freed while a real caller
  waits and a synthetic one still holds a slot, it goes to the oldest real caller;
- unbatched (requests that decode alone on their slot), every synthetic request pauses
  at its next step boundary while the extra slot is held (`PausePoint`, called where the
  decode loops check their deadline) and resumes, its KV state untouched, once it is
  freed; its deadline and cancel signal still end it there. Real requests never pause;
- batched (engine.scheduler: a slot is a batch row, the extra slot one more row), no
  PausePoint: the real request joins the running batch at the next step boundary and
  the loop pauses one synthetic row (the extra row is the only one over `max_batch`),
  which keeps its row and decode state, and resumes it unchanged at the first step with
  room for it (engine.scheduler's module doc). Real rows never pause.

Without `preempt` (engine.preempt_synthetic off, or unbatched in the CUDA-graph compile
modes) a running request is never interrupted, so a real caller may wait for the requests
already holding slots, synthetic ones included (batched, the loop still joins waiting real
requests before synthetic ones at the next step; unbatched in the CUDA-graph modes, the
device thread runs a real decode before the synthetic ones waiting: engine.owner).

`slot(deadline, synthetic=..., tokens=..., cancel=...)` is the whole interface, so a batching
scheduler can admit through it the same way; `stats()` returns the counters as an
AdmissionStats.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.cancel import CancelSignal
from engine.errors import Cancelled, Overloaded, RequestTimeout

ORIGINS = ("real", "synthetic")
# Why a caller left without a slot (the `reason` label of the Prometheus counter).
REASON_QUEUE_FULL = "queue_full"  # no free slot and the queue full (of real callers, for real)
REASON_REAL_WAITING = "real_waiting"  # synthetic: real callers were waiting
REASON_SHED = "shed"  # synthetic: removed from the queue to make room for a real caller
REASON_TIMEOUT = "timeout"  # the caller's deadline passed while it waited
REASON_TOKEN_BUDGET = "token_budget"  # no free slot and its tokens would pass max_queue_tokens
REASONS = (REASON_QUEUE_FULL, REASON_REAL_WAITING, REASON_SHED, REASON_TIMEOUT,
           REASON_TOKEN_BUDGET)
# How often a request paused for a real one looks at a cancel Event that cannot wake it
# (a CancelSignal wakes it at once).
_EVENT_POLL_S = 0.05


@dataclass(frozen=True)
class AdmissionStats:
    """Admission counters since the engine started, by origin, and the queue now.

    admitted: granted a slot. queue_full: refused on arrival (no slot, queue full).
    real_waiting: synthetic callers refused on arrival because real callers waited.
    shed: synthetic callers that queued and were removed for a real caller (Overloaded).
    timeouts: callers whose deadline passed while they waited (RequestTimeout).
    token_budget: refused on arrival (no slot, their tokens would pass max_queue_tokens).
    waiting: callers waiting for a slot now; waiting_tokens: the tokens they carry.
    preemptions: real callers granted the extra slot (synthetic requests paused for them;
        a batched engine's stats add the real requests that paused a synthetic row that
        runs alone without it: engine.scheduler).
    paused: synthetic requests paused at a step boundary for a real caller now (a batched
        engine's stats: its paused rows).
    """

    real_admitted: int = 0
    synthetic_admitted: int = 0
    real_queue_full: int = 0
    synthetic_queue_full: int = 0
    synthetic_real_waiting: int = 0
    synthetic_shed: int = 0
    real_timeouts: int = 0
    synthetic_timeouts: int = 0
    real_waiting: int = 0
    synthetic_waiting: int = 0
    real_token_budget: int = 0
    synthetic_token_budget: int = 0
    real_waiting_tokens: int = 0
    synthetic_waiting_tokens: int = 0
    preemptions: int = 0
    paused: int = 0

    @property
    def real_rejected(self) -> int:
        """Return real callers refused with Overloaded."""
        return self.real_queue_full + self.real_token_budget

    @property
    def synthetic_rejected(self) -> int:
        """Return synthetic callers refused with Overloaded (on arrival or shed)."""
        return (self.synthetic_queue_full + self.synthetic_real_waiting + self.synthetic_shed
                + self.synthetic_token_budget)

    def rejections(self) -> tuple[tuple[str, str, int], ...]:
        """Return (origin, reason, count) for every origin and reason that can occur."""
        return (("real", REASON_QUEUE_FULL, self.real_queue_full),
                ("real", REASON_TIMEOUT, self.real_timeouts),
                ("real", REASON_TOKEN_BUDGET, self.real_token_budget),
                ("synthetic", REASON_QUEUE_FULL, self.synthetic_queue_full),
                ("synthetic", REASON_REAL_WAITING, self.synthetic_real_waiting),
                ("synthetic", REASON_SHED, self.synthetic_shed),
                ("synthetic", REASON_TIMEOUT, self.synthetic_timeouts),
                ("synthetic", REASON_TOKEN_BUDGET, self.synthetic_token_budget))


class _Waiter:
    """One queued caller: woken with a slot index, or shed."""

    __slots__ = ("cond", "shed", "slot", "synthetic", "tokens")

    def __init__(self, lock: threading.Lock, synthetic: bool, tokens: int) -> None:
        self.cond = threading.Condition(lock)
        self.synthetic = synthetic
        self.tokens = tokens
        self.slot: int | None = None
        self.shed = False


class Admission:
    """Grant at most `max_concurrency` slots (`preempt`: and one extra, to a real caller
    while synthetic ones hold slots); at most `max_queue` callers wait (carrying at most
    `max_queue_tokens` tokens, 0: no token budget), real first."""

    def __init__(self, max_concurrency: int, max_queue: int, *, max_queue_tokens: int = 0,
                 retry_after_s: float = 1.0, preempt: bool = False):
        if max_concurrency < 1:
            raise ValueError("max_concurrency: must be >= 1")
        if max_queue < 0:
            raise ValueError("max_queue: must be >= 0")
        if isinstance(max_queue_tokens, bool) or not isinstance(max_queue_tokens, int) \
                or max_queue_tokens < 0:
            raise ValueError(f"max_queue_tokens: must be a whole number >= 0 (0: off), "
                             f"got {max_queue_tokens!r}")
        self._lock = threading.Lock()
        self._free = list(range(max_concurrency))
        self._capacity = max_concurrency
        self._limit = max_concurrency  # slots granted at once (set_limit), <= capacity
        self._real: deque[_Waiter] = deque()
        self._synthetic: deque[_Waiter] = deque()
        self._max_queue = max_queue
        self._max_tokens = max_queue_tokens
        self._tokens = {False: 0, True: 0}  # tokens queued, by `synthetic`
        self._retry_after_s = retry_after_s
        self._counts = dict.fromkeys(
            (f"{origin}_{what}" for origin in ORIGINS
             for what in ("admitted", "queue_full", "real_waiting", "shed", "timeouts",
                          "token_budget")), 0)
        self._counts["preemptions"] = 0
        self._preempt = preempt
        self.extra = max_concurrency  # the reserved slot's index (preempt)
        # Read without the lock at every step boundary of every synthetic request: a bool
        # written under the lock, and re-read under it before anyone waits.
        self._extra_held = False
        self._synthetic_slots: set[int] = set()  # slots held by synthetic callers
        self._resumed = threading.Condition(self._lock)  # paused synthetic requests wait
        self._paused = 0

    @property
    def waiting(self) -> int:
        """Return callers waiting for a slot."""
        with self._lock:
            return len(self._real) + len(self._synthetic)

    @property
    def running(self) -> int:
        """Return slots in use (the extra slot included)."""
        with self._lock:
            return self._capacity - len(self._free) + self._extra_held

    @property
    def preempting(self) -> bool:
        """Return whether a real caller holds the extra slot (synthetic requests pause)."""
        return self._extra_held

    @property
    def limit(self) -> int:
        """Return how many slots may be held at once now (set_limit)."""
        with self._lock:
            return self._limit

    def set_limit(self, limit: int) -> None:
        """Grant at most `limit` slots at once from now on (1 to max_concurrency).

        Lowered, the slots held above it are not taken back: they drain as their holders
        release them, and meanwhile callers wait in the bounded queue. Raised, waiting
        callers get the slots it frees at once.
        """
        if isinstance(limit, bool) or not 1 <= limit <= self._capacity:
            raise ValueError(f"limit: must be between 1 and {self._capacity}, got {limit!r}")
        if limit == self._limit:  # every request sets it: the unchanged case takes no lock
            return
        with self._lock:
            if limit == self._limit:
                return
            self._limit = limit
            while self._free and self._held() < limit and (self._real or self._synthetic):
                self._grant(self._free.pop())

    def _held(self) -> int:
        """Return slots in use (lock held)."""
        return self._capacity - len(self._free)

    def stats(self) -> AdmissionStats:
        """Return the counters and the queue now."""
        with self._lock:
            c = self._counts
            return AdmissionStats(
                real_admitted=c["real_admitted"], synthetic_admitted=c["synthetic_admitted"],
                real_queue_full=c["real_queue_full"],
                synthetic_queue_full=c["synthetic_queue_full"],
                synthetic_real_waiting=c["synthetic_real_waiting"],
                synthetic_shed=c["synthetic_shed"], real_timeouts=c["real_timeouts"],
                synthetic_timeouts=c["synthetic_timeouts"], real_waiting=len(self._real),
                synthetic_waiting=len(self._synthetic),
                real_token_budget=c["real_token_budget"],
                synthetic_token_budget=c["synthetic_token_budget"],
                real_waiting_tokens=self._tokens[False],
                synthetic_waiting_tokens=self._tokens[True],
                preemptions=c["preemptions"], paused=self._paused)

    @contextmanager
    def slot(self, deadline: float | None, *, synthetic: bool = False,
             tokens: int = 0, cancel: CancelSignal | None = None) -> Iterator[int]:
        """Hold a decode slot (its index) for the duration of the block.

        Args:
            deadline: time.perf_counter() past which waiting ends (None: no deadline).
            synthetic: a probe's request (shed before real traffic).
            tokens: what the caller carries while it waits, counted against
                max_queue_tokens: its input tokens plus the most new tokens it may decode
                (0: nothing counted).
            cancel: set by the caller to stop waiting (None: never cancelled).

        Raises Overloaded when refused or shed, RequestTimeout when `deadline` passes while
        waiting, Cancelled when `cancel` is set before a slot is granted (not counted: the
        caller left, nothing refused it).
        """
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens: must be a whole number >= 0, got {tokens!r}")
        if cancel is not None and cancel.is_set():
            raise Cancelled("request cancelled before it got a decode slot")
        # A set signal cannot notify a condition: set() wakes the waiters through this.
        unregister = None if cancel is None else cancel.on_set(self._wake_all)
        try:
            index = self._acquire(deadline, synthetic, tokens, cancel)
        finally:
            if unregister is not None:
                unregister()
        try:
            yield index
        finally:
            self._release(index)

    def _count(self, synthetic: bool, what: str) -> None:
        self._counts[f"{'synthetic' if synthetic else 'real'}_{what}"] += 1

    def _refuse(self, synthetic: bool, reason: str, message: str) -> Overloaded:
        self._count(synthetic, reason)
        return Overloaded(message, retry_after_s=self._retry_after_s)

    def _wake_all(self) -> None:
        """Wake every waiter to look at its own cancel signal (one was set)."""
        with self._lock:
            for waiter in (*self._real, *self._synthetic):
                waiter.cond.notify()

    def _acquire(self, deadline: float | None, synthetic: bool, tokens: int,
                 cancel: CancelSignal | None) -> int:
        with self._lock:
            # A slot free within the limit means nobody waits: released slots are handed
            # to waiters.
            if self._free and self._held() < self._limit:
                self._count(synthetic, "admitted")
                index = self._free.pop()
                if synthetic:
                    self._synthetic_slots.add(index)
                return index
            if not synthetic and self._can_preempt():
                return self._take_extra()
            waiter = self._enqueue(synthetic, tokens)
            try:
                while waiter.slot is None and not waiter.shed:
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        self._dequeue(waiter)
                        self._count(synthetic, "timeouts")
                        raise RequestTimeout("timeout_s: no decode slot before the deadline")
                    if cancel is not None and cancel.is_set():
                        self._dequeue(waiter)
                        raise Cancelled("request cancelled while it waited for a decode slot")
                    waiter.cond.wait(remaining)
            except BaseException:
                if waiter.slot is not None:  # granted while being interrupted: pass it on
                    self._hand_over(waiter.slot)
                elif not waiter.shed and waiter in self._queue(synthetic):
                    self._dequeue(waiter)
                raise
            if waiter.shed:
                raise Overloaded("shed: a real request needed the synthetic request's place"
                                 f" in the queue (max_queue={self._max_queue}, "
                                 f"max_queue_tokens={self._max_tokens})",
                                 retry_after_s=self._retry_after_s)
            assert waiter.slot is not None  # the loop ends granted or shed
            return waiter.slot

    def _queue(self, synthetic: bool) -> deque[_Waiter]:
        return self._synthetic if synthetic else self._real

    def _dequeue(self, waiter: _Waiter) -> None:
        """Take `waiter` out of its queue (lock held)."""
        self._queue(waiter.synthetic).remove(waiter)
        self._tokens[waiter.synthetic] -= waiter.tokens

    def _over(self, queued: int, tokens: int) -> bool:
        """Return whether `tokens` more on `queued` pass the token budget (0: none)."""
        return self._max_tokens > 0 and queued + tokens > self._max_tokens

    def _enqueue(self, synthetic: bool, tokens: int) -> _Waiter:
        """Queue a caller (lock held), shedding synthetic ones for a real one; or refuse."""
        waiting = len(self._real) + len(self._synthetic)
        queued = self._tokens[False] + self._tokens[True]
        if synthetic and self._real:
            raise self._refuse(True, REASON_REAL_WAITING,
                               f"synthetic request refused: {len(self._real)} real requests"
                               " waiting")
        # Only a real caller finding synthetic ones queued may make room; then the real
        # callers alone must leave it room (shedding every synthetic caller would).
        sheds = not synthetic and bool(self._synthetic)
        if waiting >= self._max_queue and not sheds:
            raise self._refuse(synthetic, REASON_QUEUE_FULL,
                               f"queue full: {waiting} waiting (max_queue={self._max_queue})")
        if self._over(self._tokens[False] if sheds else queued, tokens):
            raise self._refuse(synthetic, REASON_TOKEN_BUDGET,
                               f"token budget: {queued} tokens waiting and this request's "
                               f"{tokens} would pass max_queue_tokens={self._max_tokens}")
        while sheds and self._synthetic and (
                len(self._real) + len(self._synthetic) >= self._max_queue
                or self._over(self._tokens[False] + self._tokens[True], tokens)):
            # The newest synthetic caller has waited least: it loses the least.
            victim = self._synthetic.pop()
            self._tokens[True] -= victim.tokens
            victim.shed = True
            self._count(True, REASON_SHED)
            victim.cond.notify()
        waiter = _Waiter(self._lock, synthetic, tokens)
        self._queue(synthetic).append(waiter)
        self._tokens[synthetic] += tokens
        return waiter

    def _can_preempt(self) -> bool:
        """Return whether a real caller arriving now gets the extra slot (lock held): it is
        free, a synthetic caller holds a slot, and no real caller waits ahead of it."""
        return (self._preempt and not self._extra_held and bool(self._synthetic_slots)
                and not self._real)

    def _take_extra(self) -> int:
        """Hold the extra slot for a real caller (lock held): synthetic requests pause."""
        self._extra_held = True
        self._count(False, "admitted")
        self._counts["preemptions"] += 1
        return self.extra

    def wait_for_real(self, deadline: float | None, cancel: threading.Event | None) -> float:
        """Wait while a real caller holds the extra slot (a synthetic request at a step
        boundary); return the seconds waited. Raise RequestTimeout past `deadline`,
        Cancelled once `cancel` is set."""
        if not self._extra_held:  # the common case, at every step: no lock
            return 0.0
        # A set signal cannot notify a condition: set() wakes the paused through this.
        unregister = cancel.on_set(self._wake_paused) \
            if isinstance(cancel, CancelSignal) else None
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._paused += 1
                try:
                    self._pause(deadline, cancel, polls=unregister is None)
                finally:
                    self._paused -= 1
        finally:
            if unregister is not None:
                unregister()
        return time.perf_counter() - t0

    def _pause(self, deadline: float | None, cancel: threading.Event | None, *,
               polls: bool) -> None:
        """Wait (lock held) until the extra slot is freed, past `deadline` or `cancel` set;
        `polls`: `cancel` cannot wake it."""
        while self._extra_held:
            now = time.perf_counter()
            if cancel is not None and cancel.is_set():
                raise Cancelled("request cancelled while paused for a real request")
            if deadline is not None and now > deadline:
                raise RequestTimeout("timeout_s: generation did not finish before the "
                                     "deadline (paused for a real request)")
            remaining = None if deadline is None else deadline - now
            if polls and cancel is not None:
                # A plain Event wakes no one: look at it again now and then.
                remaining = _EVENT_POLL_S if remaining is None \
                    else min(remaining, _EVENT_POLL_S)
            self._resumed.wait(remaining)

    def _wake_paused(self) -> None:
        """Wake the paused synthetic requests to look at their cancel signals."""
        with self._lock:
            self._resumed.notify_all()

    def _release(self, index: int) -> None:
        with self._lock:
            self._hand_over(index)

    def _hand_over(self, index: int) -> None:
        """Give released slot `index` to the next waiter, real first, or free it (lock
        held): free it while the slots held, this one included, exceed the limit. The
        extra slot goes only to a real waiter while a synthetic caller holds a slot."""
        self._synthetic_slots.discard(index)
        if self._preempt and index == self.extra:
            self._extra_held = False
            if self._real and self._synthetic_slots:
                waiter = self._real.popleft()
                self._tokens[False] -= waiter.tokens
                waiter.slot = self._take_extra()
                waiter.cond.notify()
            else:
                self._resumed.notify_all()
            return
        if not (self._real or self._synthetic) or self._held() > self._limit:
            self._free.append(index)
            return
        self._grant(index)

    def _grant(self, index: int) -> None:
        """Give slot `index` to the next waiter, real first (lock held; one waits)."""
        queue = self._real or self._synthetic
        waiter = queue.popleft()
        self._tokens[waiter.synthetic] -= waiter.tokens
        waiter.slot = index
        if waiter.synthetic:
            self._synthetic_slots.add(index)
        self._count(waiter.synthetic, "admitted")
        waiter.cond.notify()


class PausePoint:
    """A synthetic request's step boundary: pause while a real caller holds the extra slot,
    summing the seconds paused (engine.decoding calls it where it checks the deadline)."""

    def __init__(self, admission: Admission, deadline: float | None,
                 cancel: threading.Event | None) -> None:
        self._admission, self._deadline, self._cancel = admission, deadline, cancel
        self.paused_s = 0.0
        self._pauses: list[tuple[float, float]] = []  # (resumed at, seconds paused)

    def __call__(self) -> None:
        """Wait while a real caller holds the extra slot; raise RequestTimeout or Cancelled."""
        waited = self._admission.wait_for_real(self._deadline, self._cancel)
        if waited > 0.0:
            self.paused_s += waited
            self._pauses.append((time.perf_counter(), waited))

    def unpaused(self, stamps: list[float]) -> list[float]:
        """Return token `stamps` less the pauses before each: the request's own times."""
        return unpaused(stamps, self._pauses)


def unpaused(stamps: list[float], pauses: list[tuple[float, float]]) -> list[float]:
    """Return token `stamps` less the `pauses` (resumed at, seconds paused, in order)
    before each: a paused request's own times (unbatched: PausePoint; batched: a row the
    scheduler paused).

    A pause lies between two tokens (or before the first): left in, it would count as the
    next token's decode time (a canary's per-token series, the draft length's cost of
    direct).
    """
    if not pauses:
        return stamps
    out, before, i = [], 0.0, 0
    for stamp in stamps:
        while i < len(pauses) and pauses[i][0] <= stamp:
            before += pauses[i][1]
            i += 1
        out.append(stamp - before)
    return out
