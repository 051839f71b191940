"""Unbatched preemption: a real request decodes on admission's extra slot while a synthetic
one pauses at a step boundary, and the synthetic one's tokens do not change; with
engine.preempt_synthetic off, the real request waits as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine import runtime as runtime_module
from engine.admission import PausePoint
from engine.config import EngineConfig
from engine.errors import Cancelled, RequestTimeout
from engine.protocol import CancelSignal, FlagOverride, GenerateResult
from monitor.loopback import wait_for
from tests.engine.conftest import CAP, batching_runtime

SYNTHETIC, REAL = "the quick brown fox", "hello river"


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]) -> Iterator[Any]:
    """Return an unbatched runtime (one decode stream, the default) on the tiny models."""
    rt = batching_runtime(tmp_path_factory.mktemp("preempt"), tiny_dirs, max_batch=1)
    yield rt
    rt.close()


class Preemption:
    """Hold a synthetic request at its first step boundary until a real request holds the
    extra slot, and hold that real request before it decodes until `real_may_run`."""

    def __init__(self, rt: Any, monkeypatch: pytest.MonkeyPatch, *,
                 deadline_in_s: float | None = None) -> None:
        self.at_boundary, self.go = threading.Event(), threading.Event()
        self.real_may_run = threading.Event()
        self.admission = rt._admission
        self.real_slots: list[int] = []
        gate = self

        class FirstBoundary(PausePoint):
            def __call__(self) -> None:
                if not gate.at_boundary.is_set():
                    gate.at_boundary.set()
                    assert gate.go.wait(10)
                    if deadline_in_s is not None:  # its deadline passes while it pauses
                        self._deadline = time.perf_counter() + deadline_in_s
                super().__call__()

        monkeypatch.setattr(runtime_module, "PausePoint", FirstBoundary)
        run = rt.rows.run

        def held_real(ids: list[int], length: int, key: Any, slot: int, *args: Any,
                      **kwargs: Any) -> Any:
            if kwargs.get("pause", args[-1] if args else None) is None:  # a real request
                gate.real_slots.append(slot)
                assert gate.real_may_run.wait(10)
            return run(ids, length, key, slot, *args, **kwargs)

        monkeypatch.setattr(rt.rows, "run", held_real)

    def start(self, call: Callable[[], GenerateResult]) -> Callable[[], GenerateResult]:
        """Run `call` in a thread; return what joins it and returns its result."""
        out: list[GenerateResult] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                out.append(call())
            except BaseException as exc:  # noqa: BLE001 - the joiner raises it
                errors.append(exc)

        thread = threading.Thread(target=target)
        thread.start()

        def join() -> GenerateResult:
            thread.join(30)
            assert not thread.is_alive()
            if errors:
                raise errors[0]
            return out[0]

        return join

    def paused(self) -> bool:
        """Return whether the synthetic request pauses now."""
        return bool(self.admission.stats().paused == 1)


def _generate(rt: Any, text: str, *, canary: bool, speculative: bool,
              cancel: CancelSignal | None = None) -> GenerateResult:
    return rt.generate(text, max_new_tokens=CAP, canary=canary, cancel=cancel,
                       override=FlagOverride(speculative=speculative))


@pytest.mark.parametrize("speculative", [False, True])
def test_a_synthetic_request_paused_for_a_real_one_decodes_the_same_tokens(
        rt: Any, monkeypatch: pytest.MonkeyPatch, speculative: bool) -> None:
    alone = _generate(rt, SYNTHETIC, canary=True, speculative=speculative)
    real_alone = _generate(rt, REAL, canary=False, speculative=False)
    assert alone.output_tokens > 1 and alone.preempted_s == 0.0  # steps: a boundary
    before = rt.admission_stats().preemptions
    gate = Preemption(rt, monkeypatch)
    synthetic = gate.start(lambda: _generate(rt, SYNTHETIC, canary=True,
                                             speculative=speculative))
    assert gate.at_boundary.wait(30)
    real = gate.start(lambda: _generate(rt, REAL, canary=False, speculative=False))
    # It got the extra slot at once, though the synthetic request holds the only one.
    wait_for(lambda: gate.real_slots == [gate.admission.extra], what="real on extra slot")
    assert gate.admission.preempting and rt.queue_depth() == 0
    gate.go.set()
    wait_for(gate.paused, what="the synthetic request paused")
    gate.real_may_run.set()  # it decodes while the synthetic one pauses
    real_result, paused = real(), synthetic()
    assert paused.output_ids == alone.output_ids and paused.decoding == alone.decoding
    assert real_result.output_ids == real_alone.output_ids
    assert paused.preempted_s > 0 and real_result.preempted_s == 0.0
    assert paused.preempted_s <= paused.total_s
    # Its token times are its own: the pause counts once, in total_s, not in a token's.
    assert paused.ttft_s + sum(paused.decode_token_s) + paused.preempted_s \
        <= paused.total_s - paused.queue_wait_s
    assert paused.own_s == paused.total_s - paused.preempted_s
    stats = rt.admission_stats()
    assert stats.preemptions == before + 1 and stats.paused == 0
    assert gate.admission.running == 0 and not gate.admission.preempting


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("leaves", ["past its deadline", "cancelled"])
def test_a_paused_synthetic_request_leaves_past_its_deadline_or_cancelled(
        rt: Any, monkeypatch: pytest.MonkeyPatch, leaves: str, speculative: bool) -> None:
    gate = Preemption(rt, monkeypatch,
                      deadline_in_s=0.05 if leaves == "past its deadline" else None)
    cancel = CancelSignal()
    synthetic = gate.start(lambda: _generate(rt, SYNTHETIC, canary=True,
                                             speculative=speculative, cancel=cancel))
    assert gate.at_boundary.wait(30)
    real = gate.start(lambda: _generate(rt, REAL, canary=False, speculative=False))
    wait_for(lambda: gate.admission.preempting, what="real on extra slot")
    gate.go.set()
    if leaves == "cancelled":
        wait_for(gate.paused, what="the synthetic request paused")
        cancel.set()
    # It ends while the real request still holds the extra slot, and frees its own.
    with pytest.raises(Cancelled if leaves == "cancelled" else RequestTimeout):
        synthetic()
    assert gate.admission.preempting and gate.admission.running == 1
    gate.real_may_run.set()
    assert real().preempted_s == 0.0
    assert gate.admission.running == 0 and rt.admission_stats().paused == 0
    # Its slot came back: a request gets it at once.
    assert _generate(rt, REAL, canary=True, speculative=False).output_tokens >= 1


@pytest.fixture(scope="module")
def rt_off(tmp_path_factory: pytest.TempPathFactory, tiny_dirs: dict[str, Path]
           ) -> Iterator[Any]:
    """Return an unbatched runtime with engine.preempt_synthetic off."""
    rt = batching_runtime(tmp_path_factory.mktemp("no-preempt"), tiny_dirs, max_batch=1,
                          preempt_synthetic=False)
    yield rt
    rt.close()


def test_with_preemption_off_a_real_request_waits_for_the_running_synthetic_one(
        rt_off: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    alone = _generate(rt_off, SYNTHETIC, canary=True, speculative=False)
    before = rt_off.admission_stats().preemptions
    running, go = threading.Event(), threading.Event()
    slots: list[int] = []
    run = rt_off.rows.run

    def held_first(ids: list[int], length: int, key: Any, slot: int, *args: Any,
                   **kwargs: Any) -> Any:
        slots.append(slot)
        if not running.is_set():  # the synthetic request, sent first: held while it runs
            running.set()
            assert go.wait(10)
        return run(ids, length, key, slot, *args, **kwargs)

    monkeypatch.setattr(rt_off.rows, "run", held_first)
    with ThreadPoolExecutor(2) as pool:
        synthetic = pool.submit(_generate, rt_off, SYNTHETIC, canary=True, speculative=False)
        assert running.wait(30)
        real = pool.submit(_generate, rt_off, REAL, canary=False, speculative=False)
        # The old rule: no extra slot; the real request queues behind the synthetic one.
        wait_for(lambda: rt_off.queue_depth() == 1, what="the real request queued")
        assert slots == [0] and not rt_off._admission.preempting
        go.set()
        unpaused, real_result = synthetic.result(30), real.result(30)
    assert slots == [0, 0]  # it got the slot the synthetic request freed
    assert unpaused.output_ids == alone.output_ids and unpaused.preempted_s == 0.0
    assert real_result.queue_wait_s > 0 and real_result.preempted_s == 0.0
    assert rt_off.admission_stats().preemptions == before


def test_in_the_cuda_graph_modes_a_real_decode_runs_before_the_synthetic_ones_waiting(
        tmp_path: Path, tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Unbatched, one device thread runs every decode whole: no extra slot and no pause (a
    # paused decode would hold the thread), but a real request waits only for the decode
    # running, not for the synthetic ones queued on the thread before it.
    rt = batching_runtime(tmp_path, tiny_dirs, warm=False, max_batch=1, max_concurrency=3,
                          compile_mode="reduce-overhead", native_step=False)
    try:
        owner = rt._device_thread
        assert owner is not None and not rt._preempt
        alone = {t: _generate(rt, t, canary=True, speculative=False).output_ids
                 for t in (SYNTHETIC, REAL)}
        real_ids = rt._tokenize(REAL)
        running, go = threading.Event(), threading.Event()
        ran: list[str] = []
        run = rt.rows.run

        def held_first(ids: list[int], *args: Any, **kwargs: Any) -> Any:
            assert threading.current_thread() is owner.thread
            if not running.is_set():  # the first synthetic request: held while it runs
                running.set()
                assert go.wait(10)
            ran.append("real" if list(ids) == real_ids else "synthetic")
            return run(ids, *args, **kwargs)

        monkeypatch.setattr(rt.rows, "run", held_first)
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(_generate, rt, SYNTHETIC, canary=True, speculative=False)
            assert running.wait(30)
            second = pool.submit(_generate, rt, SYNTHETIC, canary=True, speculative=False)
            wait_for(lambda: len(owner._synthetic) == 1, what="the second one queued")
            real = pool.submit(_generate, rt, REAL, canary=False, speculative=False)
            wait_for(lambda: len(owner._real) == 1, what="the real one queued")
            go.set()
            results = [f.result(30) for f in (first, second, real)]
        assert ran == ["synthetic", "real", "synthetic"]
        assert [r.output_ids for r in results] == [alone[SYNTHETIC], alone[SYNTHETIC],
                                                   alone[REAL]]
        assert all(r.preempted_s == 0.0 for r in results)
        assert rt.admission_stats().preemptions == 0
    finally:
        rt.close()


@pytest.mark.parametrize("value", ["no", "true", 0, 1, None])
def test_a_preempt_synthetic_that_is_not_a_bool_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(ValueError) as refused:
        EngineConfig(preempt_synthetic=value)  # type: ignore[arg-type]
    assert str(refused.value) == f"preempt_synthetic: must be true or false, got {value!r}"


def test_preempt_synthetic_leaves_the_config_hash_as_before_it_existed() -> None:
    # The defaults' hash before the setting: artifacts and baselines keyed by it stay valid.
    # Either value: preemption changes no compiled artifact.
    assert EngineConfig().preempt_synthetic is True
    assert EngineConfig().config_hash() == "b836dd3af226"
    assert EngineConfig(preempt_synthetic=False).config_hash() == "b836dd3af226"
