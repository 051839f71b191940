"""The device thread (engine.owner): one thread runs every call, real calls before the
synthetic ones waiting, each kind in order; a failing call fails its caller only."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.errors import NotReady
from engine.owner import DeviceThread
from monitor.loopback import wait_for


def _queued(owner: DeviceThread) -> int:
    return len(owner._real) + len(owner._synthetic)


def _queued_is(owner: DeviceThread, count: int) -> bool:
    return _queued(owner) == count


def test_real_calls_run_before_the_synthetic_ones_waiting_each_kind_in_order() -> None:
    owner = DeviceThread(name="test-owner")
    ran: list[str] = []
    threads: set[threading.Thread] = set()
    go = threading.Event()

    def task(name: str, *, hold: bool = False):
        def fn() -> str:
            threads.add(threading.current_thread())
            if hold:
                assert go.wait(10)
            ran.append(name)
            return name
        return fn

    try:
        with ThreadPoolExecutor(5) as pool:
            first = pool.submit(owner.call, task("synthetic running", hold=True),
                                synthetic=True)
            wait_for(lambda: bool(threads), what="the first call running")
            futures = []
            # Arrivals while it runs: two synthetic calls, then two real ones.
            for name, synthetic in (("synthetic 1", True), ("synthetic 2", True),
                                    ("real 1", False), ("real 2", False)):
                futures.append(pool.submit(owner.call, task(name), synthetic=synthetic))
                wait_for(functools.partial(_queued_is, owner, len(futures)),
                         what=f"{name} queued")
            go.set()
            assert first.result(10) == "synthetic running"
            assert [f.result(10) for f in futures] == [
                "synthetic 1", "synthetic 2", "real 1", "real 2"]
        # The running call was not interrupted; the real ones went ahead of the waiting
        # synthetic ones, which kept their own order.
        assert ran == ["synthetic running", "real 1", "real 2", "synthetic 1", "synthetic 2"]
        assert threads == {owner.thread}
    finally:
        go.set()
        owner.close()


def test_a_failing_call_fails_its_caller_only_and_the_thread_goes_on() -> None:
    owner = DeviceThread(name="test-owner")
    try:
        def fails() -> None:
            raise RuntimeError("its own")

        with pytest.raises(RuntimeError, match="its own"):
            owner.call(fails, synthetic=True)
        assert owner.call(lambda: 7) == 7
        # A call made from the thread itself runs at once (no wait on its own queue).
        assert owner.call(lambda: owner.call(lambda: "inner", synthetic=True)) == "inner"
    finally:
        owner.close()


def test_close_finishes_what_was_submitted_then_refuses() -> None:
    owner = DeviceThread(name="test-owner")
    started, go, ran = threading.Event(), threading.Event(), []

    def held() -> bool:
        started.set()
        return go.wait(10)

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(owner.call, held)
        assert started.wait(10)
        waiting = pool.submit(owner.call, lambda: ran.append("waiting"), synthetic=True)
        wait_for(lambda: _queued(owner) == 1, what="queued")
        closing = pool.submit(owner.close)
        go.set()
        closing.result(10)
        assert running.result(10) is True and waiting.result(10) is None
    assert ran == ["waiting"] and not owner.thread.is_alive()
    with pytest.raises(NotReady, match="engine is closed"):
        owner.call(lambda: None)
