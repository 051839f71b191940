"""Admission control: real traffic before synthetic, shedding, counters (no torch)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

import pytest

from engine.admission import REASONS, Admission, AdmissionStats, PausePoint
from engine.errors import Cancelled, Overloaded, RequestTimeout
from engine.protocol import CancelSignal
from monitor.loopback import wait_for


class Caller:
    """A thread that asks for a slot, records when it got one and which (or what it
    raised), leaves (once `hold` is set, when given)."""

    def __init__(self, admission: Admission, name: str, *, synthetic: bool,
                 order: list[str], tokens: int = 0, deadline: float | None = None,
                 cancel: CancelSignal | None = None, hold: threading.Event | None = None
                 ) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.index: int | None = None
        self._admission, self._synthetic, self._order = admission, synthetic, order
        self._tokens, self._deadline, self._cancel = tokens, deadline, cancel
        self._hold = hold
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self._admission.slot(self._deadline, synthetic=self._synthetic,
                                      tokens=self._tokens, cancel=self._cancel) as index:
                self.index = index
                self._order.append(self.name)
                if self._hold is not None:
                    self._hold.wait(10)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive(), f"{self.name} still waiting"


def until(check: Callable[[], bool]) -> None:
    """Wait until another thread's effect is visible (a condition, not a timing)."""
    wait_for(check, interval_s=0.001, what="admission queue state")


def queued(admission: Admission, *, real: int, synthetic: int) -> Callable[[], bool]:
    def check() -> bool:
        s = admission.stats()
        return (s.real_waiting, s.synthetic_waiting) == (real, synthetic)
    return check


def test_a_freed_slot_goes_to_waiting_real_callers_before_synthetic_ones() -> None:
    admission = Admission(1, 4)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        s1 = Caller(admission, "s1", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=1))
        s2 = Caller(admission, "s2", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=2))
        r1 = Caller(admission, "r1", synthetic=False, order=order)
        until(queued(admission, real=1, synthetic=2))
        r2 = Caller(admission, "r2", synthetic=False, order=order)
        until(queued(admission, real=2, synthetic=2))
        assert order == []
    for c in (s1, s2, r1, r2):
        c.join()
        assert c.error is None
    assert order == ["r1", "r2", "s1", "s2"]  # real first, each origin in arrival order
    stats = admission.stats()
    assert (stats.real_admitted, stats.synthetic_admitted) == (3, 2)
    assert stats.real_rejected == stats.synthetic_rejected == 0
    assert admission.waiting == 0 and admission.running == 0


def test_a_real_caller_finding_the_queue_full_takes_a_synthetic_callers_place() -> None:
    admission = Admission(1, 2)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        s1 = Caller(admission, "s1", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=1))
        s2 = Caller(admission, "s2", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=2))
        r1 = Caller(admission, "r1", synthetic=False, order=order)
        s2.join()  # the newest synthetic caller is shed at once
        assert isinstance(s2.error, Overloaded) and "shed" in str(s2.error)
        until(queued(admission, real=1, synthetic=1))
        r2 = Caller(admission, "r2", synthetic=False, order=order)
        s1.join()
        assert isinstance(s1.error, Overloaded)
        until(queued(admission, real=2, synthetic=0))
        # A queue of real callers only: now a real caller is refused.
        with pytest.raises(Overloaded, match="queue full"), admission.slot(None):
            pass
    for c in (r1, r2):
        c.join()
        assert c.error is None
    assert order == ["r1", "r2"]
    assert admission.stats() == AdmissionStats(real_admitted=3, real_queue_full=1,
                                               synthetic_shed=2)


def test_a_synthetic_caller_does_not_queue_while_real_callers_wait() -> None:
    admission = Admission(1, 8)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None, synthetic=True))
        r1 = Caller(admission, "r1", synthetic=False, order=order)
        until(queued(admission, real=1, synthetic=0))
        with pytest.raises(Overloaded, match="real requests waiting"), \
                admission.slot(None, synthetic=True):
            pass
    r1.join()
    assert order == ["r1"]
    stats = admission.stats()
    assert stats.synthetic_real_waiting == 1 and stats.synthetic_rejected == 1
    assert (stats.real_admitted, stats.synthetic_admitted) == (1, 1)
    # With nobody waiting, a synthetic caller gets a free slot like any other.
    with admission.slot(None, synthetic=True) as index:
        assert index == 0
    assert admission.stats().synthetic_admitted == 2


def test_synthetic_callers_fill_the_queue_only_up_to_max_queue() -> None:
    admission = Admission(1, 1)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        s1 = Caller(admission, "s1", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=1))
        with pytest.raises(Overloaded, match="queue full"), admission.slot(None, synthetic=True):
            pass
    s1.join()
    assert order == ["s1"]
    assert admission.stats().synthetic_queue_full == 1


@pytest.mark.parametrize("leaves", ["past its deadline", "cancelled"])
@pytest.mark.parametrize("synthetic", [False, True])
def test_a_queued_caller_leaves_the_queue_past_its_deadline_or_cancelled(
        synthetic: bool, leaves: str) -> None:
    admission = Admission(1, 4)
    cancelled = leaves == "cancelled"
    cancel = CancelSignal()
    with admission.slot(None):
        # A deadline already past ends the wait at once; a cancel is set once it waits,
        # and nothing else (no deadline, no freed slot) could wake it.
        caller = Caller(admission, "c", synthetic=synthetic, order=[], cancel=cancel,
                        deadline=None if cancelled else time.perf_counter())
        if cancelled:
            until(queued(admission, real=int(not synthetic), synthetic=int(synthetic)))
            cancel.set()
        caller.join()
        assert isinstance(caller.error, Cancelled if cancelled else RequestTimeout)
        assert admission.waiting == 0
    stats = admission.stats()
    # A timeout is counted by origin; a cancel is the caller leaving, not a refusal.
    timeouts = (0, 0) if cancelled else (0, 1) if synthetic else (1, 0)
    assert (stats.real_timeouts, stats.synthetic_timeouts) == timeouts
    assert sum(n for _origin, _reason, n in stats.rejections()) == sum(timeouts)
    with admission.slot(None) as index:  # the slot came back; the queue holds no ghost
        assert index == 0


def test_a_caller_cancelled_before_it_asks_gets_no_slot() -> None:
    admission = Admission(1, 4)
    cancel = CancelSignal()
    cancel.set()
    with pytest.raises(Cancelled), admission.slot(None, cancel=cancel):
        pass
    assert admission.stats().real_admitted == 0 and admission.running == 0


def test_rejections_name_every_origin_and_reason() -> None:
    stats = AdmissionStats(real_queue_full=1, real_timeouts=2, synthetic_queue_full=3,
                           synthetic_real_waiting=4, synthetic_shed=5, synthetic_timeouts=6,
                           real_token_budget=7, synthetic_token_budget=8)
    assert stats.rejections() == (
        ("real", "queue_full", 1), ("real", "timeout", 2), ("real", "token_budget", 7),
        ("synthetic", "queue_full", 3), ("synthetic", "real_waiting", 4),
        ("synthetic", "shed", 5), ("synthetic", "timeout", 6),
        ("synthetic", "token_budget", 8))
    assert {reason for _origin, reason, _n in stats.rejections()} == set(REASONS)
    assert (stats.real_rejected, stats.synthetic_rejected) == (8, 20)


def test_bad_limits_name_the_setting() -> None:
    with pytest.raises(ValueError, match="max_concurrency"):
        Admission(0, 1)
    with pytest.raises(ValueError, match="max_queue"):
        Admission(1, -1)


def test_a_lowered_limit_queues_callers_as_one_slot_would_and_a_raised_one_wakes_them():
    admission = Admission(4, max_queue=1)
    order: list[str] = []
    admission.set_limit(1)  # the batching flag off: one row at a time
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        assert admission.running == 1
        waiter = Caller(admission, "waits", synthetic=False, order=order)
        until(queued(admission, real=1, synthetic=0))
        # Three rows are free, but the limit holds: the queue (max_queue 1) is full.
        with pytest.raises(Overloaded, match="queue full"), admission.slot(None):
            pass
        assert admission.stats().real_queue_full == 1
    waiter.join()  # the released slot went to the waiter
    assert order == ["waits"] and waiter.error is None
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        late = Caller(admission, "late", synthetic=True, order=order)
        until(queued(admission, real=0, synthetic=1))
        admission.set_limit(4)  # the flag back on: the waiter gets a free row at once
        late.join()
        assert order == ["waits", "late"] and late.error is None
    assert admission.running == 0 and admission.limit == 4


def test_slots_held_above_a_lowered_limit_drain_before_anyone_else_gets_one():
    admission = Admission(3, max_queue=4)
    order: list[str] = []
    first, second = ExitStack(), ExitStack()
    first.enter_context(admission.slot(None))
    second.enter_context(admission.slot(None))
    admission.set_limit(1)
    waiter = Caller(admission, "waits", synthetic=False, order=order)
    until(queued(admission, real=1, synthetic=0))
    first.close()  # two held, limit 1: freed, not handed over
    assert admission.stats().real_waiting == 1 and admission.running == 1
    second.close()
    waiter.join()
    assert order == ["waits"]


@pytest.mark.parametrize("limit", [0, 5, True])
def test_a_limit_out_of_range_is_refused_naming_it(limit):
    with pytest.raises(ValueError, match="limit: must be between 1 and 4"):
        Admission(4, max_queue=1).set_limit(limit)


def test_a_real_caller_takes_the_extra_slot_while_a_synthetic_one_holds_the_only_slot():
    admission = Admission(1, 4, preempt=True)
    order: list[str] = []
    with ExitStack() as held:
        assert held.enter_context(admission.slot(None, synthetic=True)) == 0
        with admission.slot(None) as index:  # at once: no queue, no wait
            assert index == admission.extra == 1 and admission.preempting
            assert admission.running == 2
            # Only real callers take it, one at a time: the next of each origin queues.
            s1 = Caller(admission, "s1", synthetic=True, order=order)
            until(queued(admission, real=0, synthetic=1))
            r1 = Caller(admission, "r1", synthetic=False, order=order)
            until(queued(admission, real=1, synthetic=1))
            assert order == []
        # Freed while a real caller waits and a synthetic one holds a slot: the real one's.
        r1.join()
        assert order == ["r1"] and r1.index == admission.extra and r1.error is None
        assert not admission.preempting and admission.stats().synthetic_waiting == 1
    s1.join()  # the synthetic holder left: the slot it freed went to the synthetic waiter
    assert order == ["r1", "s1"] and s1.index == 0 and s1.error is None
    stats = admission.stats()
    assert (stats.real_admitted, stats.synthetic_admitted, stats.preemptions) == (2, 2, 2)
    assert admission.running == 0 and admission.waiting == 0
    with admission.slot(None, synthetic=True), admission.slot(None) as index:
        assert index == admission.extra  # it went back: the next real caller gets it
    assert admission.stats().preemptions == 3


@pytest.mark.parametrize("holder", ["synthetic, no preempt", "real, preempt"])
def test_without_a_synthetic_holder_or_preempt_a_real_caller_waits(holder: str) -> None:
    admission = Admission(1, 4, preempt=holder.endswith(", preempt"))
    order: list[str] = []
    with admission.slot(None, synthetic=holder.startswith("synthetic")):
        real = Caller(admission, "r", synthetic=False, order=order)
        until(queued(admission, real=1, synthetic=0))
        assert not admission.preempting and admission.running == 1
    real.join()
    assert order == ["r"] and real.index == 0 and admission.stats().preemptions == 0


@pytest.mark.parametrize("ends", ["resumed", "past its deadline", "cancelled", "event set"])
def test_a_paused_synthetic_request_waits_for_the_extra_slot_unless_it_must_leave(
        ends: str) -> None:
    admission = Admission(1, 4, preempt=True)
    pause = PausePoint(admission, None, None)
    pause()  # nothing preempts: no wait
    assert pause.paused_s == 0.0
    cancel: threading.Event = threading.Event() if ends == "event set" else CancelSignal()
    deadline = time.perf_counter() if ends == "past its deadline" else None
    pause = PausePoint(admission, deadline, cancel)
    errors: list[BaseException] = []

    def step_boundary() -> None:
        try:
            pause()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    with admission.slot(None, synthetic=True), admission.slot(None):
        paused = threading.Thread(target=step_boundary)
        paused.start()
        if ends != "past its deadline":
            until(lambda: admission.stats().paused == 1)
        if ends in ("cancelled", "event set"):
            cancel.set()
        if ends != "resumed":  # it leaves while the real caller still holds the slot
            paused.join(10)
            assert not paused.is_alive() and admission.preempting
    paused.join(10)
    assert not paused.is_alive() and admission.stats().paused == 0
    expected = {"resumed": [], "past its deadline": [RequestTimeout],
                "cancelled": [Cancelled], "event set": [Cancelled]}[ends]
    assert [type(e) for e in errors] == expected
    if ends == "resumed":
        assert pause.paused_s > 0


def test_a_pause_is_left_out_of_the_token_times_after_it() -> None:
    class Paused:
        def wait_for_real(self, deadline: float | None, cancel: object) -> float:
            return 2.0

    pause = PausePoint(Paused(), None, None)  # type: ignore[arg-type]
    before = time.perf_counter()
    pause()
    after = time.perf_counter()
    assert pause.paused_s == 2.0
    assert pause.unpaused([before, after, after + 1.0]) == [before, after - 2.0, after - 1.0]
