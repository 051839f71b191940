"""Batched preemption (engine.scheduler with admission's extra row): a real request that
would wait while synthetic requests hold every row gets a row at once and joins the
running batch at the next step; a synthetic row pauses so that a step stays at max_batch
rows, and every request's tokens are what it decodes alone at batch 1."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, cast

import pytest

from engine import native
from engine.decoding import RowState
from engine.errors import Cancelled
from engine.protocol import FlagOverride, GenerateResult
from engine.scheduler import Job, Scheduler
from engine.scheduler_recorder import Recorded, StepRecorder
from monitor.loopback import wait_for
from tests.engine.conftest import CAP, batching_runtime, random_texts

# Two inputs that decode CAP tokens alone (they outlast the real one by far) and one that
# stops after a few.
_TEXTS = random_texts(8, seed=61, overflow=False)
SYNTHETIC, REAL = (_TEXTS[1], _TEXTS[2]), _TEXTS[4]
REAL_MAX = 16


class Gate(StepRecorder):
    """A recorder that holds the loop twice: as the first row joins, until `admitted` is
    set (the test's synthetic requests are all handed to the loop, so they join one step
    apart at most), and after the first step of `rows` rows, all synthetic, until `go` is
    set (the batch is full of them); `hold_real`: also after the first step with a real
    row, until `go_on` is set. It keeps each step's jobs."""

    def __init__(self, rows: int, *, hold_real: bool = False) -> None:
        super().__init__()
        self.rows = rows
        self.admitted, self.full, self.go = threading.Event(), threading.Event(), \
            threading.Event()
        self.real_stepped, self.go_on = threading.Event(), threading.Event()
        if not hold_real:
            self.go_on.set()
        self.full_at = -1  # the loop's step count after the full step
        self.steps: list[tuple[Job, ...]] = []

    def release(self) -> None:
        """Let the loop go on past every hold (a test's teardown, passed or failed)."""
        for event in (self.admitted, self.go, self.go_on):
            event.set()

    def joined(self, job: Recorded, encode_s: float) -> None:
        super().joined(job, encode_s)
        assert self.admitted.wait(30)

    def stepped(self, phase: str, seconds: float, jobs: Sequence[Recorded]) -> None:
        super().stepped(phase, seconds, jobs)
        rows = tuple(cast(Job, job) for job in jobs)
        self.steps.append(rows)
        if not self.full.is_set() and len(rows) == self.rows \
                and all(job.synthetic for job in rows):
            self.full_at = self.totals()[0]
            self.full.set()
            assert self.go.wait(30)
        if not self.real_stepped.is_set() and any(not job.synthetic for job in rows):
            self.real_stepped.set()
            assert self.go_on.wait(30)


@contextmanager
def _gated(rt: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[Gate, list[Job]]]:
    """Hold `rt`'s loop at `gate` and note the jobs handed to it; release and close after."""
    try:
        handed = _handed(rt, monkeypatch)
        rt._scheduler.recorder = gate
        yield gate, handed
    finally:
        gate.release()
        rt.close()


def _handed(rt: Any, monkeypatch: pytest.MonkeyPatch) -> list[Job]:
    """Return the list of jobs handed to the loop from now on, in order."""
    sched = rt._scheduler
    submit, handed = sched.submit, []

    def noted(job: Job) -> None:
        submit(job)
        handed.append(job)

    monkeypatch.setattr(sched, "submit", noted)
    return handed


def _generate(rt: Any, text: str, *, canary: bool, max_new: int,
              override: FlagOverride) -> GenerateResult:
    return rt.generate(text, max_new_tokens=max_new, canary=canary, override=override)


def _fill(rt: Any, pool: ThreadPoolExecutor, gate: Gate, handed: list[Job],
          override: FlagOverride, texts: Sequence[str]) -> list[Future]:
    """Send synthetic requests for `texts` and return their futures once the batch is full
    of them, the loop held at a step boundary."""
    futures = [pool.submit(_generate, rt, t, canary=True, max_new=CAP, override=override)
               for t in texts]
    wait_for(lambda: len(handed) == len(texts), what="the synthetic requests handed over")
    gate.admitted.set()
    assert gate.full.wait(30)
    return futures


def _check_paused(result: GenerateResult, job: Job) -> None:
    """The paused request's result carries its pauses and leaves them out of its times."""
    assert job.preempted_s > 0 and result.preempted_s == job.preempted_s
    assert result.preempted_s <= result.total_s
    assert result.ttft_s + sum(result.decode_token_s) + result.preempted_s \
        <= result.total_s - result.queue_wait_s
    assert result.own_s == result.total_s - result.preempted_s


@pytest.mark.parametrize(("native_step", "speculative", "compile_mode"),
                         [(True, False, "default"), (True, True, "default"),
                          (False, False, "default"), (False, False, "reduce-overhead")],
                         ids=["c-step", "c-step-speculative", "fixed-row-step",
                              "fixed-row-step-cuda-graph-mode"])
def test_a_real_request_joins_at_once_while_synthetic_rows_fill_the_batch(
        tmp_path, tiny_dirs, alone, monkeypatch, native_step, speculative, compile_mode):
    # In the CUDA-graph modes too: the loop is the one thread making compiled calls, and
    # pausing a row keeps every step in the batch-size classes the warm-up recorded.
    if native_step and native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2, native_step=native_step,
                          compile_mode=compile_mode)
    with _gated(rt, Gate(rows=2), monkeypatch) as (gate, handed):
        for text in SYNTHETIC:
            assert len(alone(text, CAP)) == CAP  # they run far past the real one
        if not native_step:
            # Three rows (two and the extra one), one batch-size class: a step stays at two.
            buffers = rt.rows.buffers["target"]
            assert buffers.fixed and buffers.rows == 3 and buffers.sizes == (2,)
        compiled = rt.compile_snapshot()
        before = rt.admission_stats().preemptions
        with ThreadPoolExecutor(3) as pool:
            synthetic = _fill(rt, pool, gate, handed,
                              FlagOverride(speculative=speculative), SYNTHETIC)
            real = pool.submit(_generate, rt, REAL, canary=False, max_new=REAL_MAX,
                               override=FlagOverride(speculative=False))
            # Granted a row at once (the extra one) and handed to the loop, which is
            # still held after a step of the two synthetic rows: no one finished.
            wait_for(lambda: len(handed) == 3, what="the real request handed to the loop")
            assert handed[2].row == rt._admission.extra and rt._admission.preempting
            assert rt.queue_depth() == 0
            assert rt.admission_stats().preemptions == before + 1
            gate.go.set()
            real_result = real.result(60)
            results = [f.result(60) for f in synthetic]
        assert real_result.output_ids == alone(REAL, REAL_MAX)
        for text, result in zip(SYNTHETIC, results, strict=True):
            assert result.output_ids == alone(text, CAP), text
        # It joined at the step boundary after the full step, and stepped beside the older
        # synthetic row every step; no step held more than max_batch rows.
        assert real_result.batch_join_step == gate.full_at
        assert real_result.batch_size_max == 2 and real_result.batch_size_mean == 2.0
        assert max(len(rows) for rows in gate.steps) == 2
        # The newest synthetic row paused while the real one ran, the oldest never did.
        first, second = handed[0], handed[1]
        assert first.pauses == [] and len(second.pauses) == 1
        assert all(second not in rows for rows in gate.steps
                   if any(not job.synthetic for job in rows))
        paused = [r for r in results if r.preempted_s > 0]
        assert len(paused) == 1
        _check_paused(paused[0], second)
        stats = rt.admission_stats()
        assert stats.preemptions == before + 1 and stats.paused == 0
        assert rt._admission.running == 0 and not rt._admission.preempting
        after = rt.compile_snapshot()
        assert (after.graphs, after.recompiles) == (compiled.graphs, compiled.recompiles)
        if compile_mode == "reduce-overhead":  # the warm-up recorded the extra row too
            assert rt.graph_snapshot().recorded_after_warmup == 0


def test_in_the_cuda_graph_modes_a_real_row_left_alone_on_the_extra_row_replays(
        tmp_path, tiny_dirs, alone, monkeypatch):
    # The real request outlives the synthetic rows and, alone, speculates on the extra
    # row's own caches: the warm-up recorded those calls too, so none records after it.
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2, native_step=False,
                          compile_mode="reduce-overhead")
    short = 2
    with _gated(rt, Gate(rows=2), monkeypatch) as (gate, handed):
        recorded = rt.graph_snapshot().recorded_after_warmup
        with ThreadPoolExecutor(3) as pool:
            synthetic = [pool.submit(_generate, rt, t, canary=True, max_new=short,
                                     override=FlagOverride(speculative=False))
                         for t in SYNTHETIC]
            wait_for(lambda: len(handed) == 2, what="the synthetic requests handed over")
            gate.admitted.set()
            assert gate.full.wait(30)
            real = pool.submit(_generate, rt, REAL, canary=False, max_new=CAP,
                               override=FlagOverride(speculative=True))
            wait_for(lambda: len(handed) == 3, what="the real request handed to the loop")
            assert handed[2].row == rt._admission.extra
            gate.go.set()
            real_result = real.result(60)
            results = [f.result(60) for f in synthetic]
        assert real_result.output_ids == alone(REAL, CAP)
        for text, result in zip(SYNTHETIC, results, strict=True):
            assert result.output_ids == alone(text, short)
        assert real_result.spec.drafts > 0  # it speculated once alone
        assert rt.graph_snapshot().recorded_after_warmup == recorded == 0


def test_a_paused_synthetic_row_that_is_cancelled_leaves_and_changes_no_one_else(
        tmp_path, tiny_dirs, alone, monkeypatch):
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2)
    with _gated(rt, Gate(rows=2, hold_real=True), monkeypatch) as (gate, handed):
        with ThreadPoolExecutor(3) as pool:
            synthetic = _fill(rt, pool, gate, handed, FlagOverride(speculative=False),
                              SYNTHETIC)
            real = pool.submit(_generate, rt, REAL, canary=False, max_new=REAL_MAX,
                               override=FlagOverride(speculative=False))
            wait_for(lambda: len(handed) == 3, what="the real request handed to the loop")
            gate.go.set()
            assert gate.real_stepped.wait(30)
            # The loop is held after the real row's first step: the newest synthetic row
            # is paused now. Its caller hangs up; it leaves at the next step boundary.
            oldest, newest = handed[0], handed[1]
            assert newest.paused_at is not None and rt.admission_stats().paused == 1
            newest.cancel()
            gate.go_on.set()
            real_result = real.result(60)
            errors = [f.exception(60) for f in synthetic]
        (left,) = [i for i, error in enumerate(errors) if error is not None]
        assert isinstance(errors[left], Cancelled)
        kept = synthetic[1 - left].result()
        assert kept.output_ids == alone(SYNTHETIC[1 - left], CAP) and kept.preempted_s == 0.0
        assert real_result.output_ids == alone(REAL, REAL_MAX)
        assert oldest.pauses == [] and newest.paused_at is None and len(newest.pauses) == 1
        # Its row and the extra one are free again, and nothing is paused.
        assert rt._admission.running == 0 and not rt._admission.preempting
        assert rt.admission_stats().paused == 0
        assert rt.generate(REAL, max_new_tokens=REAL_MAX, canary=True,
                           override=FlagOverride(speculative=False)).output_ids \
            == alone(REAL, REAL_MAX)


def test_a_real_request_does_not_wait_for_a_synthetic_one_that_runs_alone(
        tmp_path, tiny_dirs, alone, monkeypatch):
    # The burst's unbatched arm: a synthetic request with no batch-mates. The real one gets
    # a free row from admission and joins at once; the synthetic one pauses meanwhile.
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2)
    with _gated(rt, Gate(rows=1), monkeypatch) as (gate, handed):
        before = rt.admission_stats().preemptions
        with ThreadPoolExecutor(2) as pool:
            (synthetic,) = _fill(rt, pool, gate, handed,
                                 FlagOverride(speculative=False, batching=False),
                                 SYNTHETIC[:1])
            real = pool.submit(_generate, rt, REAL, canary=False, max_new=REAL_MAX,
                               override=FlagOverride(speculative=False))
            wait_for(lambda: len(handed) == 2, what="the real request handed to the loop")
            assert handed[0].alone and handed[1].row != rt._admission.extra
            gate.go.set()
            real_result, result = real.result(60), synthetic.result(60)
        assert real_result.output_ids == alone(REAL, REAL_MAX)
        assert result.output_ids == alone(SYNTHETIC[0], CAP)
        # It joined at the next step boundary and ran alone; the synthetic one never
        # shared a step either.
        assert real_result.batch_join_step == gate.full_at
        assert real_result.batch_size_max == 1 and result.batch_size_max == 1
        _check_paused(result, handed[0])
        # No extra row granted it: the loop counts this preemption.
        stats = rt.admission_stats()
        assert stats.preemptions == before + 1 and stats.paused == 0


def test_with_preemption_off_a_batched_real_request_waits_for_a_synthetic_row(
        tmp_path, tiny_dirs, alone, monkeypatch):
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2, preempt_synthetic=False)
    with _gated(rt, Gate(rows=2), monkeypatch) as (gate, handed):
        before = rt.admission_stats().preemptions
        with ThreadPoolExecutor(3) as pool:
            synthetic = _fill(rt, pool, gate, handed, FlagOverride(speculative=False),
                              SYNTHETIC)
            real = pool.submit(_generate, rt, REAL, canary=False, max_new=REAL_MAX,
                               override=FlagOverride(speculative=False))
            # The old rule: no extra row; it queues until a synthetic request leaves.
            wait_for(lambda: rt.queue_depth() == 1, what="the real request queued")
            assert len(handed) == 2 and not rt._admission.preempting
            gate.go.set()
            real_result = real.result(60)
            results = [f.result(60) for f in synthetic]
        assert real_result.output_ids == alone(REAL, REAL_MAX)
        for text, result in zip(SYNTHETIC, results, strict=True):
            assert result.output_ids == alone(text, CAP) and result.preempted_s == 0.0
        assert handed[2].row in (0, 1) and real_result.batch_join_step > gate.full_at
        assert rt.admission_stats().preemptions == before


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _job(row: int, *, synthetic: bool, alone: bool = False) -> Job:
    return Job(ids=[5], length=2, key=None, k=0, max_new=1, deadline=None, quantized=False,
               row=row, synthetic=synthetic, alone=alone)


def test_a_step_decodes_the_real_rows_and_the_oldest_synthetic_rows_that_fit() -> None:
    clock = _Clock()
    # Rows 0 and 1, and admission's extra row 2. The loop idles: the test sets its rows.
    sched = Scheduler(cast(Any, None), max_batch=2, window_max_s=0.0, waiting=lambda: 0,
                      clock=clock, extra_row=2)
    state = cast(RowState, object())

    def stepping(*jobs: Job) -> list[Job]:
        sched._active = [(job, state) for job in jobs]
        return [job for job, _state in sched._stepping()]

    try:
        s0, s1, real = _job(0, synthetic=True), _job(1, synthetic=True), _job(2, synthetic=False)
        assert stepping(s0, s1) == [s0, s1]
        # The extra row's real job steps with the older synthetic row; the newer pauses.
        assert stepping(s0, s1, real) == [s0, real]
        clock.now = 10.0
        sched._pause(sched._stepping(), clock.now)
        assert (s0.paused_at, s1.paused_at) == (None, 10.0) and sched.paused == 1
        assert sched.snapshot().batch_size == 2
        assert sched.preemptions == 0  # the extra row's: admission counted it
        # A synthetic row leaves: the paused one resumes, its pause recorded.
        assert stepping(s1, real) == [s1, real]
        clock.now = 12.5
        sched._pause(sched._stepping(), clock.now)
        assert s1.paused_at is None and s1.pauses == [(12.5, 2.5)] and s1.preempted_s == 2.5
        # Joining: a real job counts the real rows only, a synthetic one every row (it
        # never joins to pause).
        other_real = _job(0, synthetic=False)
        assert sched._fits(other_real, []) and not sched._fits(_job(3, synthetic=True), [])
        assert not sched._fits(_job(3, synthetic=False), [other_real])  # two real rows
        # A synthetic row that runs alone pauses beside any real row, without the extra
        # row: the loop counts that preemption; a real one that runs alone steps alone.
        solo = _job(0, synthetic=True, alone=True)
        real_on_1 = _job(1, synthetic=False)
        assert stepping(solo, real_on_1) == [real_on_1]
        clock.now = 20.0
        sched._pause(sched._stepping(), clock.now)
        assert sched.preemptions == 1 and solo.paused_at == 20.0
        clock.now = 21.0
        sched._finish(solo, None, RuntimeError("left paused"))  # its pause ends there
        assert solo.pauses == [(21.0, 1.0)] and solo.paused_at is None
        real_solo = _job(2, synthetic=False, alone=True)
        assert stepping(s0, real_solo) == [real_solo]
        # Without preemption every row steps, as before.
        sched.extra_row = None
        assert stepping(s0, s1, real) == [s0, s1, real]
        assert not sched._fits(_job(0, synthetic=False), [])  # the batch is full
    finally:
        sched._active = []
        sched.close()
