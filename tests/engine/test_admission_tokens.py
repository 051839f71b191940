"""Admission's token budget (engine.max_queue_tokens): real threads, real-first shedding,
the budget's accounting as callers leave the queue, and the setting's checks (no torch)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from engine.admission import Admission
from engine.config import EngineConfig
from engine.errors import Overloaded, RequestTimeout
from tests.engine.test_admission import Caller, queued, until


def test_a_caller_whose_tokens_would_pass_the_budget_is_refused_with_retry_after() -> None:
    admission = Admission(1, 8, max_queue_tokens=100, retry_after_s=2.5)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None, tokens=500))  # running: never counted
        r1 = Caller(admission, "r1", synthetic=False, order=order, tokens=60)
        until(queued(admission, real=1, synthetic=0))
        r2 = Caller(admission, "r2", synthetic=False, order=order, tokens=40)  # 100: fits
        until(queued(admission, real=2, synthetic=0))
        with pytest.raises(Overloaded, match="max_queue_tokens=100") as refused, \
                admission.slot(None, tokens=1):
            pass
        assert refused.value.retry_after_s == 2.5
        with pytest.raises(Overloaded, match="real requests waiting"), \
                admission.slot(None, synthetic=True, tokens=1):
            pass  # refused for the real callers waiting, before its tokens matter
        assert admission.stats().real_waiting_tokens == 100
    for c in (r1, r2):
        c.join()
        assert c.error is None
    assert order == ["r1", "r2"]
    stats = admission.stats()
    assert (stats.real_token_budget, stats.real_queue_full, stats.real_admitted) == (1, 0, 3)
    assert stats.synthetic_real_waiting == 1 and stats.synthetic_token_budget == 0
    assert stats.real_rejected == 1
    assert stats.real_waiting_tokens == stats.synthetic_waiting_tokens == 0


def test_a_synthetic_caller_over_the_budget_is_refused_for_tokens() -> None:
    admission = Admission(1, 8, max_queue_tokens=100)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None, synthetic=True))
        s1 = Caller(admission, "s1", synthetic=True, order=order, tokens=90)
        until(queued(admission, real=0, synthetic=1))
        with pytest.raises(Overloaded, match="token budget"), \
                admission.slot(None, synthetic=True, tokens=11):
            pass
        # Exactly at the budget is within it.
        s2 = Caller(admission, "s2", synthetic=True, order=order, tokens=10)
        until(queued(admission, real=0, synthetic=2))
    for c in (s1, s2):
        c.join()
        assert c.error is None
    stats = admission.stats()
    assert (stats.synthetic_token_budget, stats.synthetic_shed) == (1, 0)
    assert stats.synthetic_rejected == 1


def test_a_real_caller_sheds_the_newest_synthetic_callers_until_its_tokens_fit() -> None:
    admission = Admission(1, 8, max_queue_tokens=100)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        synthetic = []
        for i, tokens in enumerate((30, 30, 20, 20)):
            synthetic.append(Caller(admission, f"s{i}", synthetic=True, order=order,
                                    tokens=tokens))
            until(queued(admission, real=0, synthetic=i + 1))
        # 100 queued; 55 more need 55 out: the newest two (40) are not enough, three are.
        r1 = Caller(admission, "r1", synthetic=False, order=order, tokens=55)
        for c in synthetic[1:]:
            c.join()
            assert isinstance(c.error, Overloaded) and "shed" in str(c.error)
        until(queued(admission, real=1, synthetic=1))
        assert admission.stats().real_waiting_tokens == 55
        assert admission.stats().synthetic_waiting_tokens == 30
    for c in (r1, synthetic[0]):
        c.join()
        assert c.error is None
    assert order == ["r1", "s0"]  # the oldest synthetic caller kept its place
    stats = admission.stats()
    assert (stats.synthetic_shed, stats.real_token_budget) == (3, 0)


def test_no_synthetic_caller_is_shed_when_shedding_all_of_them_would_not_make_room() -> None:
    admission = Admission(1, 8, max_queue_tokens=100)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None, synthetic=True))
        s1 = Caller(admission, "s1", synthetic=True, order=order, tokens=30)
        until(queued(admission, real=0, synthetic=1))
        r1 = Caller(admission, "r1", synthetic=False, order=order, tokens=70)  # 100: fits
        until(queued(admission, real=1, synthetic=1))
        # Real callers hold 70: 31 more cannot fit even with s1 shed; s1 stays.
        with pytest.raises(Overloaded, match="token budget"), admission.slot(None, tokens=31):
            pass
        assert admission.stats().synthetic_waiting == 1
    for c in (r1, s1):
        c.join()
        assert c.error is None
    assert order == ["r1", "s1"]
    stats = admission.stats()
    assert (stats.real_token_budget, stats.synthetic_shed) == (1, 0)


def test_a_full_count_and_a_full_budget_are_both_made_room_for_by_shedding() -> None:
    admission = Admission(1, 2, max_queue_tokens=100)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        s1 = Caller(admission, "s1", synthetic=True, order=order, tokens=10)
        until(queued(admission, real=0, synthetic=1))
        s2 = Caller(admission, "s2", synthetic=True, order=order, tokens=10)
        until(queued(admission, real=0, synthetic=2))
        # The count is full (2 of 2): one shed for the place; tokens fit after it.
        r1 = Caller(admission, "r1", synthetic=False, order=order, tokens=85)
        s2.join()
        assert isinstance(s2.error, Overloaded)
        until(queued(admission, real=1, synthetic=1))
        # A place is free, 5 tokens are not: s1 goes for the tokens alone.
        r2 = Caller(admission, "r2", synthetic=False, order=order, tokens=15)
        s1.join()
        assert isinstance(s1.error, Overloaded) and "max_queue_tokens=100" in str(s1.error)
        until(queued(admission, real=2, synthetic=0))
    for c in (r1, r2):
        c.join()
        assert c.error is None
    assert order == ["r1", "r2"]
    assert admission.stats().synthetic_shed == 2


@pytest.mark.parametrize("synthetic", [False, True])
def test_a_caller_timing_out_in_the_queue_takes_its_tokens_with_it(synthetic: bool) -> None:
    admission = Admission(1, 4, max_queue_tokens=100)
    with admission.slot(None):
        # Queued (100 tokens fit), then its deadline (already past) ends the wait.
        with pytest.raises(RequestTimeout), \
                admission.slot(time.perf_counter(), synthetic=synthetic, tokens=100):
            pass
        stats = admission.stats()
        assert (stats.real_timeouts, stats.synthetic_timeouts) == \
            ((0, 1) if synthetic else (1, 0))
        assert stats.real_waiting_tokens == stats.synthetic_waiting_tokens == 0
        r = Caller(admission, "r", synthetic=synthetic, order=[], tokens=100)
        until(lambda: admission.waiting == 1)  # the whole budget is free again
        assert admission.stats().real_token_budget == 0
    r.join()
    assert r.error is None


def test_a_budget_of_zero_counts_nothing() -> None:
    admission = Admission(1, 2)
    order: list[str] = []
    with ExitStack() as held:
        held.enter_context(admission.slot(None))
        r1 = Caller(admission, "r1", synthetic=False, order=order, tokens=10**9)
        until(queued(admission, real=1, synthetic=0))
    r1.join()
    assert r1.error is None and admission.stats().real_token_budget == 0


@pytest.mark.parametrize("value", [-1, True, 1.5, "100"])
def test_bad_budgets_and_token_counts_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="^max_queue_tokens: must be a whole number"):
        Admission(1, 1, max_queue_tokens=value)  # type: ignore[arg-type]
    admission = Admission(1, 1, max_queue_tokens=100)
    with pytest.raises(ValueError, match="^tokens: must be a whole number"), \
            admission.slot(None, tokens=value):  # type: ignore[arg-type]
        pass
    assert admission.running == 0


@pytest.mark.parametrize(("value", "message"), [
    (-1, "max_queue_tokens: must be a whole number of tokens >= 0 (0: off), got -1"),
    (True, "max_queue_tokens: must be a whole number of tokens >= 0 (0: off), got True"),
    (2.5, "max_queue_tokens: must be a whole number of tokens >= 0 (0: off), got 2.5"),
    ("64", "max_queue_tokens: must be a whole number of tokens >= 0 (0: off), got '64'"),
    (1279, "max_queue_tokens: must be 0 (off) or at least max_input_tokens + "
           "max_new_tokens_cap (1280: the largest request), got 1279"),
])
def test_the_engine_config_refuses_a_bad_budget_in_one_line(value: object,
                                                             message: str) -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(max_queue_tokens=value)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_the_engine_config_takes_off_and_budgets_that_hold_the_largest_request() -> None:
    assert EngineConfig().max_queue_tokens == 0  # off by default
    assert EngineConfig(max_queue_tokens=1280).max_queue_tokens == 1280
    assert EngineConfig(max_input_tokens=256, max_new_tokens_cap=64,
                        max_queue_tokens=320).max_queue_tokens == 320
