"""The garbage collector in a serving process: the warm heap frozen once, pauses timed."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.protocol import FlagProvider, InMemoryFlagProvider
from monitor.engine_holder import FAILED, READY, WARMING, EngineHolder
from monitor.gc_heap import PAUSE_SECONDS_EDGES, GcPauses, GcSnapshot
from monitor.loopback import wait_for
from monitor.metrics import GcCollector, Metrics
from tests.monitor.fakes import FakeFactory, ServiceFakeEngine

ROOT = Path(__file__).resolve().parents[2]


def test_freeze_keeps_live_objects_out_of_collections_and_frees_garbage_first() -> None:
    # In a process of its own: a freeze in the test process would outlive this test.
    script = textwrap.dedent("""
        import gc, weakref
        from monitor import gc_heap

        class Node:
            pass

        live = [[i] for i in range(50_000)]           # the warm heap: tracked, alive
        cycle = Node(); cycle.me = cycle                # garbage in a reference cycle
        freed = []
        weakref.finalize(cycle, freed.append, True)
        del cycle
        gc.disable()                                    # only freeze() may collect it
        walked = len(gc.get_objects())
        frozen = gc_heap.freeze()
        assert freed == [True], "garbage alive at the freeze must be collected first"
        assert frozen >= 50_000, frozen
        assert len(gc.get_objects()) < walked - 50_000  # collections no longer walk them
        later = [[i] for i in range(1_000)]
        assert gc_heap.freeze() <= frozen  # once per process: `later` stays unfrozen
        assert len(gc.get_objects()) >= 1_000           # what comes later is collected
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


def test_pauses_are_timed_by_generation() -> None:
    ticks = iter([10.0, 10.3, 20.0, 20.0004])
    pauses = GcPauses(clock=lambda: next(ticks))
    pauses.install()
    pauses.install()  # idempotent: one callback, so each collection counts once
    gc.disable()  # only the collections below, each with its two clock reads
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        gc.enable()
        pauses.uninstall()
    gc.collect(2)  # uninstalled: not counted
    snap = pauses.snapshot()
    assert snap.count == (1, 0, 1)
    assert abs(snap.seconds[2] - 0.3) < 1e-9 and abs(snap.seconds[0] - 0.0004) < 1e-9
    # Cumulative: the 0.3 s pause is in the buckets from 0.5 s up, the 0.4 ms one from 1 ms.
    assert snap.buckets[2] == tuple(int(edge >= 0.3) for edge in PAUSE_SECONDS_EDGES)
    assert snap.buckets[0] == tuple(int(edge >= 0.0004) for edge in PAUSE_SECONDS_EDGES)
    assert snap.buckets[1] == (0,) * len(PAUSE_SECONDS_EDGES)


def test_a_snapshot_taken_while_collecting_on_the_same_thread_does_not_deadlock() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        with pauses._lock:  # as snapshot() holds it when its allocations start a collection
            gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.snapshot().count[2] == 1


def test_the_collector_exports_pauses_and_frozen_objects() -> None:
    registry = CollectorRegistry()
    n = len(PAUSE_SECONDS_EDGES)
    GcCollector(Metrics(registry), snapshot=lambda: GcSnapshot(
        count=(40, 3, 1), seconds=(0.004, 0.002, 0.31),
        buckets=((40,) * n, (3,) * n, tuple(int(e >= 0.31) for e in PAUSE_SECONDS_EDGES)),
        frozen=460_000))
    value = registry.get_sample_value
    assert value("tailwatch_gc_pause_seconds_count", {"generation": "2"}) == 1
    assert value("tailwatch_gc_pause_seconds_sum", {"generation": "2"}) == 0.31
    assert value("tailwatch_gc_pause_seconds_bucket", {"generation": "2", "le": "0.25"}) == 0
    assert value("tailwatch_gc_pause_seconds_bucket", {"generation": "2", "le": "0.5"}) == 1
    assert value("tailwatch_gc_pause_seconds_bucket", {"generation": "0", "le": "+Inf"}) == 40
    assert value("tailwatch_gc_frozen_objects") == 460_000


def _holder(factory: FakeFactory, frozen: list[tuple[str, str]]) -> EngineHolder:
    def freeze() -> int:
        # What the holder says at this moment is what a freeze follows.
        frozen.append(holder.state())
        return 7

    holder = EngineHolder(factory, EngineConfig(), InMemoryFlagProvider(), freeze=freeze)
    return holder


def test_the_holder_freezes_the_heap_once_the_engine_is_warm() -> None:
    factory, frozen = FakeFactory(hold_warmup=True), list[tuple[str, str]]()
    holder = _holder(factory, frozen)
    holder.start()
    try:
        factory.built.wait(10)
        assert frozen == []  # not while warming: warm-up's graphs are not built yet
        assert factory.engine is not None
        factory.engine.finish_warmup.set()
        wait_for(lambda: frozen != [])
        # Not ready while freezing: the freeze's own collection would stall routed traffic.
        assert frozen == [(WARMING, "freezing the heap")]
        wait_for(lambda: holder.state()[0] == READY)
    finally:
        holder.close()


def test_readiness_comes_even_if_the_freeze_fails() -> None:
    def freeze() -> int:
        raise RuntimeError("no gc here")

    factory = FakeFactory()
    holder = EngineHolder(factory, EngineConfig(), InMemoryFlagProvider(), freeze=freeze)
    holder.start()
    try:
        wait_for(lambda: holder.state()[0] == READY)
    finally:
        holder.close()


def test_the_holder_freezes_after_a_failed_warm_up_too() -> None:
    # The engine serves on (eager where cold): its heap is as warm as it gets.
    class Failing(FakeFactory):
        def __call__(self, config: EngineConfig,
                     flags: FlagProvider) -> ServiceFakeEngine:
            engine = super().__call__(config, flags)

            def warm_up(*, background: bool = True) -> None:
                raise RuntimeError("inductor crashed")

            engine.warm_up = warm_up  # type: ignore[method-assign]
            return engine

    frozen: list[tuple[str, str]] = []
    holder = _holder(Failing(), frozen)
    holder.start()
    try:
        wait_for(lambda: frozen != [])
        assert frozen[0][0] == FAILED
        assert "inductor crashed" in holder.state()[1]
    finally:
        holder.close()


def test_a_holder_closed_while_warming_does_not_freeze() -> None:
    factory, frozen = FakeFactory(hold_warmup=True), list[tuple[str, str]]()
    holder = _holder(factory, frozen)
    holder.start()
    factory.built.wait(10)
    assert factory.engine is not None
    closing = threading.Thread(target=holder.close, kwargs={"timeout_s": 10})
    closing.start()
    wait_for(lambda: holder._closed.is_set())
    factory.engine.finish_warmup.set()
    closing.join(15)
    assert frozen == []


def test_the_app_freezes_its_heap_and_exports_the_pauses(client: TestClient) -> None:
    # The fixture's app is ready: its engine is warm, so the process's heap is frozen.
    client.post("/v1/generate", json={"text": "hello river"})
    text = client.get("/metrics").text
    frozen = [line for line in text.splitlines()
              if line.startswith("tailwatch_gc_frozen_objects ")]
    assert frozen and float(frozen[0].split()[1]) > 0
    assert 'tailwatch_gc_pause_seconds_count{generation="2"}' in text
    assert gc.get_freeze_count() > 0
