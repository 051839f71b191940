"""Continuous batching (engine.scheduler): rows join and leave a running batch, and every
request's tokens are what it decodes alone at batch 1."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import native
from engine import scheduler as scheduler_module
from engine.config import EngineConfig
from engine.errors import BoundaryError, Cancelled, DoesNotFit, InputTooLong, RequestTimeout
from engine.protocol import CancelSignal, FlagOverride
from engine.runtime import Runtime
from engine.scheduler import Job
from engine.scheduler_recorder import StepRecorder
from monitor.loopback import wait_for
from tests.engine.batching import (
    Handshake,
    break_row,
    make_job,
    narrow_cross,
    submit_together,
)
from tests.engine.conftest import batching_runtime, random_texts

DIRECT = FlagOverride(speculative=False)  # as `alone` decodes


@pytest.mark.parametrize(("native_step", "eager"), [(True, False), (False, True),
                                                    (False, False)])
def test_rows_joining_and_leaving_mid_flight_decode_what_they_decode_alone(
        tmp_path, tiny_dirs, alone, native_step, eager):
    if native_step and native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=4, native_step=native_step)
    try:
        texts = random_texts(8, seed=21)  # every bucket and the overflow path
        # Mixed token limits: rows leave at different steps; two speculate when alone.
        first = [make_job(rt, t, row, max_new=m, eager=eager, k=k) for row, (t, m, k) in
                 enumerate(zip(texts[:4], (40, 5, 12, 3), (0, 2, 0, 0), strict=True))]
        submit_together(rt, first)
        first[0].first_token.wait()
        for job in first[1:]:
            rt._scheduler.wait(job)
        later = [make_job(rt, t, row, max_new=m, eager=eager, k=k) for row, (t, m, k) in
                 zip((1, 2, 3), zip(texts[4:7], (7, 40, 9), (2, 0, 0), strict=True),
                     strict=True)]
        submit_together(rt, later)
        for job, text in zip(first + later, texts[:7], strict=True):
            got = rt._scheduler.wait(job).tokens
            assert tuple(got) == alone(text, job.max_new)[:len(got)], text
            assert len(got) == len(alone(text, job.max_new)), text
        assert first[0].batch_max == 4  # they joined one step together
        assert all(job.joined_step > 0 for job in later)  # joined a running loop
        snap = rt.batch_snapshot()
        assert snap.max_batch == 4 and snap.steps > 0 and snap.step_count["decode"] > 0
        assert snap.batch_size == 0 and snap.step_count["encode"] == 7
    finally:
        rt.close()


def test_a_lone_row_speculates_and_stays_exact(tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4)
    try:
        for text in random_texts(6, seed=5):
            out = rt.generate(text, max_new_tokens=16, override=FlagOverride(speculative=True))
            assert out.output_ids == alone(text)
            assert out.decoding == "speculative" and out.spec.drafts > 0
            assert out.batch_size_max == 1 and out.batch_join_step >= 0
        assert rt.batch_snapshot().step_count["verify"] > 0
    finally:
        rt.close()


def test_a_lone_row_verifies_through_the_unbatched_engines_c_entry(
        tmp_path, tiny_dirs, alone, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4)
    try:
        step = rt.target.native
        rows, verify = step.rows, step.verify
        over_rows: list[int] = []
        verified: list[int] = []

        def counted_rows(m, tokens, *args, **kwargs):
            over_rows.append(int(tokens.shape[0]))
            return rows(m, tokens, *args, **kwargs)

        def counted_verify(m, tokens, *args, **kwargs):
            verified.append(int(tokens.shape[-1]))
            return verify(m, tokens, *args, **kwargs)

        monkeypatch.setattr(step, "rows", counted_rows)
        monkeypatch.setattr(step, "verify", counted_verify)
        for text in random_texts(4, seed=5):
            out = rt.generate(text, max_new_tokens=16, override=FlagOverride(speculative=True))
            assert out.output_ids == alone(text)
            assert out.spec.drafts > 0
        # Every verification one call on the row's own caches, none over rows: as a lone
        # request on the unbatched engine, without the per-position lists of native.rows.
        assert over_rows == []
        assert any(positions > 1 for positions in verified)
    finally:
        rt.close()


def test_concurrent_callers_get_their_own_tokens(tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4, max_queue=32)
    texts = random_texts(16, seed=8)
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda t: rt.generate(t, max_new_tokens=16), texts))
        for text, res in zip(texts, results, strict=True):
            assert res.output_ids == alone(text), text
            assert 1 <= res.batch_size_mean <= res.batch_size_max <= 4
            assert res.batch_wait_s >= 0
    finally:
        rt.close()


@pytest.mark.parametrize("leaves", ["cancelled", "past its deadline"])
def test_a_row_that_leaves_mid_answer_frees_its_row_and_changes_no_one_else(
        tmp_path, tiny_dirs, alone, leaves):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=2)
    texts = random_texts(3, seed=13, overflow=False)
    try:
        keep, drop = make_job(rt, texts[0], 0, max_new=40), make_job(rt, texts[1], 1, max_new=40)
        drop.first_token = Handshake()
        submit_together(rt, [keep, drop])
        drop.first_token.wait()
        # While the loop waits: it leaves mid-answer, at the next step boundary.
        if leaves == "cancelled":
            drop.cancel()
        else:
            drop.deadline = 0.0
        drop.first_token.go.set()
        with pytest.raises(Cancelled if leaves == "cancelled" else RequestTimeout):
            rt._scheduler.wait(drop)
        # Its row is free: another request takes it while `keep` still runs or after.
        again = make_job(rt, texts[2], 1, max_new=16)
        rt._scheduler.submit(again)
        assert tuple(rt._scheduler.wait(keep).tokens) == alone(texts[0], 40)
        assert tuple(rt._scheduler.wait(again).tokens) == alone(texts[2], 16)
    finally:
        rt.close()


@pytest.mark.parametrize("leaves", ["cancelled", "past its deadline"])
def test_a_generate_call_that_leaves_mid_answer_frees_its_row_and_changes_no_one_else(
        tmp_path, tiny_dirs, alone, monkeypatch, leaves):
    """Through Runtime.generate: its CancelSignal (or deadline) reaches the loop's row."""
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2)
    texts = random_texts(3, seed=13, overflow=False)
    sched = rt._scheduler
    jobs: list[scheduler_module.Job] = []
    submit = sched.submit

    def held(job: scheduler_module.Job) -> None:
        # The loop holds after each of the first two requests' first token until the test
        # has acted on it.
        if len(jobs) < 2:
            job.first_token = Handshake()
        jobs.append(job)
        submit(job)

    monkeypatch.setattr(sched, "submit", held)
    cancel = CancelSignal()
    out: dict[str, object] = {}

    def call(name: str, text: str, **kwargs: object) -> threading.Thread:
        def run() -> None:
            try:
                out[name] = rt.generate(text, max_new_tokens=40, override=DIRECT, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                out[name] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        keeper = call("keep", texts[0])
        wait_for(lambda: len(jobs) == 1, what="the first job handed to the loop")
        keep = jobs[0]
        keep.first_token.wait()
        dropper = call("drop", texts[1], cancel=cancel)
        wait_for(lambda: len(jobs) == 2, what="the second job handed to the loop")
        drop = jobs[1]
        keep.first_token.go.set()  # the next step boundary takes `drop` into the batch
        drop.first_token.wait()
        if leaves == "cancelled":
            cancel.set()
        else:
            drop.deadline = 0.0
        drop.first_token.go.set()
        dropper.join(30)
        assert isinstance(out["drop"], Cancelled if leaves == "cancelled" else RequestTimeout)
        # Its row is out of the batch and its admission slot back: another request takes it.
        assert all(job is not drop for job, _state in sched._active)
        again = rt.generate(texts[2], max_new_tokens=16, override=DIRECT)
        assert again.output_ids == alone(texts[2], 16)
        keeper.join(30)
        kept = out["keep"]
        assert not isinstance(kept, BaseException), kept
        assert kept.output_ids == alone(texts[0], 40)  # token for token
        assert kept.batch_size_max == 2  # it shared steps with `drop`
    finally:
        rt.close()


def test_a_failing_request_errors_only_its_caller_and_the_loop_survives(
        tmp_path, tiny_dirs, alone, monkeypatch):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3, native_step=False)
    texts = random_texts(3, seed=17, overflow=False)

    def spoil(state):  # its cross K/V has the wrong width: its step raises
        state.tenc = narrow_cross(state.tenc, c_step=False)

    start_row = break_row(rt, monkeypatch, spoil)
    try:
        jobs = [make_job(rt, t, row, eager=True) for row, t in enumerate(texts)]
        submit_together(rt, jobs)
        with pytest.raises(RuntimeError):
            rt._scheduler.wait(jobs[1])
        for i in (0, 2):
            assert tuple(rt._scheduler.wait(jobs[i]).tokens) == alone(texts[i])
        monkeypatch.setattr(rt.rows, "start_row", start_row)
        assert rt.generate(texts[1], max_new_tokens=16).output_ids == alone(texts[1])
    finally:
        rt.close()


def test_a_request_that_cannot_fit_a_row_is_refused_naming_the_limit(tmp_path, tiny_dirs):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=2)
    try:
        job = make_job(rt, "hello", 0, max_new=rt.slots + 1)
        with pytest.raises(DoesNotFit) as err:
            rt._scheduler.submit(job)
        assert isinstance(err.value, InputTooLong)  # HTTP 413 at the edge
        assert err.value.field == "max_new_tokens" and err.value.limit == rt.slots
        assert str(rt.slots) in str(err.value)
    finally:
        rt.close()


@pytest.mark.parametrize(("field", "value"), [("max_batch", 0), ("max_batch", 1000),
                                              ("max_batch", True),
                                              ("batch_window_max_s", -0.1),
                                              ("batch_window_max_s", 5.0)])
def test_bad_batching_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: must be between"):
        EngineConfig(**{field: value})


def test_the_window_shortens_while_callers_wait_and_lengthens_while_none_do(tmp_path,
                                                                            tiny_dirs):
    from engine.scheduler import Scheduler

    now, waiting = [0.0], [0]
    sched = Scheduler(None, max_batch=4, window_max_s=0.01,  # type: ignore[arg-type]
                      waiting=lambda: waiting[0], clock=lambda: now[0])
    try:
        assert sched.snapshot().window_s == 0.01  # idle at start: the whole window
        waiting[0] = 3
        seen = []
        for _ in range(60):  # a minute of callers waiting for rows
            now[0] += 1.0
            sched._adapt_window()
            seen.append(sched.snapshot().window_s)
        assert seen == sorted(seen, reverse=True) and seen[-1] < 0.001
        waiting[0] = 0
        for _ in range(60):
            now[0] += 1.0
            sched._adapt_window()
        assert 0.009 < sched.snapshot().window_s <= 0.01
    finally:
        sched.close()


def test_a_window_lets_a_second_arrival_join_the_first_step(tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2, batch_window_max_s=1.0)
    texts = random_texts(2, seed=3, overflow=False)
    try:
        jobs = [make_job(rt, t, row) for row, t in enumerate(texts)]
        for job in jobs:  # one after the other: the window holds the first step
            rt._scheduler.submit(job)
        for job, text in zip(jobs, texts, strict=True):
            assert tuple(rt._scheduler.wait(job).tokens) == alone(text)
            assert job.joined_step == 0 and job.batch_max == 2
    finally:
        rt.close()


@pytest.mark.parametrize("native_step", [True, False])
def test_a_row_left_alone_speculates_after_batched_steps_and_stays_exact(
        tmp_path, tiny_dirs, alone, native_step):
    if native_step and native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=2, native_step=native_step)
    texts = random_texts(2, seed=31, overflow=False)
    try:
        long, short = make_job(rt, texts[0], 0, k=3, max_new=40), make_job(rt, texts[1], 1, max_new=3)
        submit_together(rt, [long, short])
        decoded = rt._scheduler.wait(long)
        # Batched while `short` ran (direct steps), then alone: the draft catches up on
        # those tokens and rounds run, every token still the target's own.
        assert tuple(decoded.tokens) == alone(texts[0], 40)
        assert tuple(rt._scheduler.wait(short).tokens) == alone(texts[1], 3)
        assert short.batch_max == 2 and decoded.spec.drafts > 0
        assert decoded.spec.target_forwards > decoded.spec.drafts  # direct steps too
    finally:
        rt.close()


def test_several_rows_speculate_when_measured_rounds_beat_the_batched_step():
    from types import SimpleNamespace

    from engine.scheduler import Scheduler

    sched = Scheduler(None, max_batch=4, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: 0)
    try:
        spec, plain = SimpleNamespace(can_speculate=True), SimpleNamespace(can_speculate=False)
        two = [(None, spec), (None, spec)]
        assert sched._speculate([(None, spec)])  # alone: always, as unbatched
        assert not sched._speculate(two)  # nothing measured yet: the batched step
        sched._round_tps = 1000.0  # tokens per second of rounds
        assert not sched._speculate(two)  # the batched step at 2 rows not measured yet
        sched._step_s[2] = 0.004  # 500 tokens per second batched
        assert sched._speculate(two)
        sched._step_s[2] = 0.001  # 2000 tokens per second batched
        assert not sched._speculate(two)
        sched._step_s[2] = 0.004
        assert not sched._speculate([(None, spec), (None, plain)])  # one row has no draft
    finally:
        sched.close()


class _Favour:
    """Measured costs (engine.scheduler.StepCosts) that make the loop's choice: a call's
    fixed cost far above its cost per position makes verifying every row's proposals pay
    (`speculate`), the reverse makes direct steps pay."""

    def __init__(self, speculate: bool) -> None:
        self.draft_s = self.draft_encoder_s = 1e-9
        self._fit = (1.0, 1e-9) if speculate else (1e-9, 1.0)

    def fit(self) -> tuple[float, float]:
        return self._fit

    def acceptance(self, state) -> float:
        return 0.5

    def observe(self, positions, seconds) -> None:
        pass

    def observe_draft(self, proposals, seconds) -> None:
        pass

    def observe_draft_call(self, positions, seconds) -> None:
        pass

    def draft_seconds(self, ks, batched) -> float:
        return self.draft_s * sum(ks)

    def observe_draft_encoder(self, seconds) -> None:
        pass

    def observe_acceptance(self, accepted, block, choice) -> None:
        pass


def _count_c_calls(rt: Runtime, monkeypatch, runner=None) -> list[tuple[int, int]]:
    """Record (rows of distinct requests, positions) of every C call on the target (or on
    `runner`)."""
    calls: list[tuple[int, int]] = []
    step = (runner or rt.target).native
    rows, verify = step.rows, step.verify

    def counted_rows(m, tokens, positions, caches, *args, **kwargs):
        calls.append((len({id(c) for c in caches}), len(caches)))
        return rows(m, tokens, positions, caches, *args, **kwargs)

    def counted_verify(m, tokens, *args, **kwargs):
        calls.append((1, tokens.shape[-1]))
        return verify(m, tokens, *args, **kwargs)

    monkeypatch.setattr(step, "rows", counted_rows)
    monkeypatch.setattr(step, "verify", counted_verify)
    return calls


@pytest.mark.parametrize("batch_drafts", [True, False])
def test_rows_speculating_together_verify_in_one_call_and_stay_exact(
        tmp_path, tiny_dirs, alone, monkeypatch, batch_drafts):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=4)
    texts = random_texts(7, seed=41, overflow=False)  # mixed buckets
    try:
        sched = rt._scheduler
        sched._costs = _Favour(speculate=True)
        sched.batch_drafts = batch_drafts
        calls = _count_c_calls(rt, monkeypatch)
        draft_calls = _count_c_calls(rt, monkeypatch, rt.models.draft)
        # Mixed token limits and draft lengths (one row without a draft), joining together
        # and later into a running batch; rows leave at different steps.
        first = [make_job(rt, t, row, k=k, max_new=m) for row, (t, m, k) in
                 enumerate(zip(texts[:4], (40, 6, 17, 3), (3, 2, 0, 1), strict=True))]
        submit_together(rt, first)
        first[0].first_token.wait()
        for job in first[1:]:
            sched.wait(job)
        later = [make_job(rt, t, row, k=k, max_new=m) for row, (t, m, k) in
                 zip((1, 2, 3), zip(texts[4:7], (9, 40, 12), (2, 3, 1), strict=True),
                     strict=True)]
        submit_together(rt, later)
        for job, text in zip(first + later, texts, strict=True):
            decoded = sched.wait(job)
            assert tuple(decoded.tokens) == alone(text, job.max_new), text
            assert (decoded.spec.drafts > 0) == (job.k > 0), text
        assert first[0].batch_max == 4 and all(j.joined_step > 0 for j in later)
        # Several rows' proposals checked by one call on the target: each weight read once
        # for every position of every row (no per-row verification).
        assert any(rows > 1 and positions > rows for rows, positions in calls)
        assert max(rows for rows, _positions in calls) == 4
        # The drafts of the rows that speculate propose together (one call a draft step,
        # three at most: the rows with the longest k), or each in its own calls.
        together = [rows for rows, _positions in draft_calls if rows > 1]
        assert (max(together, default=1) == 3) == batch_drafts
        snap = rt.batch_snapshot()
        assert snap.step_count["verify"] > 0
    finally:
        rt.close()


def test_drafts_proposing_together_propose_bitwise_what_each_proposes_alone(
        tmp_path, tiny_dirs):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=8)
    texts = random_texts(4, seed=47, overflow=False)  # mixed buckets
    ks = [3, 1, 0, 2]  # rows drop out of later draft steps; one feeds only its token
    sched = rt._scheduler
    draft_calls = []

    def rounds(first_row: int, together: bool) -> list[tuple[list[list[int]], list]]:
        """Two proposals of each row, with tokens the draft has not seen before each
        (none, one, several: its catch-up), the first settled by made-up choices."""
        jobs = [make_job(rt, t, first_row + i, k=3, max_new=40) for i, t in enumerate(texts)]
        rows = [(job, rt.rows.start_row(job)) for job in jobs]
        sched.batch_drafts = together
        seen = []
        for r in range(2):
            for i, (_job, state) in enumerate(rows):
                for t in range((i * 2 + r) % 5):
                    state.accept(10 + t + i, 0.0)
            blocks = {id(job): block for job, _s, block in sched._proposals(rows, ks)}
            ordered = [blocks[id(job)] for job, _s in rows]
            seen.append((ordered, [(s.d_pos, s._pending, s.draft_steps, s.position + k,
                                    s.dcache[..., :s.position + k, :].clone() if k else None)
                                   for (_j, s), k in zip(rows, ks, strict=True)]))
            for i, ((_job, state), block) in enumerate(zip(rows, ordered, strict=True)):
                if len(block) > 1:  # row 0 accepts every proposal, the others one at most
                    choice = block[1:] + [7] if i == 0 else [block[1], 7] + block[2:]
                    state.settle(block, choice[:len(block)], 0.0, 0.0)
        return seen

    def both() -> tuple[list, list]:
        return rounds(0, together=False), rounds(4, together=True)

    step = rt.models.draft.native
    rows_fn = step.rows

    def counted(m, tokens, positions, caches, *args, **kwargs):
        draft_calls.append(len({id(c) for c in caches}))
        return rows_fn(m, tokens, positions, caches, *args, **kwargs)

    try:
        step.rows = counted
        alone_, together_ = sched.call(both)
        assert max(draft_calls) == 3  # the rows with k > 0 in one call
        for (blocks_a, rows_a), (blocks_t, rows_t) in zip(alone_, together_, strict=True):
            assert blocks_a == blocks_t
            assert [len(b) - 1 for b in blocks_a] == ks
            for a, t in zip(rows_a, rows_t, strict=True):
                assert a[:4] == t[:4]  # d_pos, the position after the proposals, steps
                assert (a[4] is None and t[4] is None) or torch.equal(a[4], t[4])
    finally:
        del step.rows
        rt.close()


def test_a_row_whose_draft_fails_among_drafts_proposing_together_fails_alone(
        tmp_path, tiny_dirs, alone, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(3, seed=53, overflow=False)

    def spoil(state):  # its draft's cross K/V has the wrong width: its proposals fail
        make = state._make_denc
        state._make_denc = lambda: narrow_cross(make(), c_step=True)

    break_row(rt, monkeypatch, spoil)
    try:
        rt._scheduler._costs = _Favour(speculate=True)
        jobs = [make_job(rt, t, row, k=3, max_new=20) for row, t in enumerate(texts)]
        submit_together(rt, jobs)
        with pytest.raises(BoundaryError):
            rt._scheduler.wait(jobs[1])
        for i in (0, 2):
            decoded = rt._scheduler.wait(jobs[i])
            assert tuple(decoded.tokens) == alone(texts[i], 20)
            assert decoded.spec.drafts > 0
    finally:
        rt.close()


def test_the_loop_steps_direct_when_measured_costs_say_verifying_does_not_pay(
        tmp_path, tiny_dirs, alone, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(3, seed=43, overflow=False)
    try:
        sched = rt._scheduler
        sched._costs = _Favour(speculate=False)
        sched.turns = False  # the choice between verifying and direct steps, not turns
        monkeypatch.setattr(scheduler_module, "EXPLORE_EVERY", 10**9)  # no exploring
        jobs = [make_job(rt, t, row, k=3, max_new=24) for row, t in enumerate(texts)]
        submit_together(rt, jobs)
        for job, text in zip(jobs, texts, strict=True):
            decoded = sched.wait(job)
            assert tuple(decoded.tokens) == alone(text, 24), text
        # Batched direct steps while several rows run; a row left alone speculates.
        assert rt.batch_snapshot().step_count["decode"] > 0
    finally:
        rt.close()


def test_step_costs_fit_a_call_as_fixed_plus_per_position_and_choose_from_it():
    from types import SimpleNamespace

    from engine.scheduler import Scheduler, StepCosts

    costs = StepCosts()
    assert costs.fit() is None
    costs.observe(8, 0.001 + 8 * 0.0003)
    assert costs.fit() is None  # one size of call: fixed and per-position not told apart
    for n in (8, 40, 8, 40, 16):
        costs.observe(n, 0.001 + n * 0.0003)
    fixed, per = costs.fit()
    assert fixed == pytest.approx(0.001) and per == pytest.approx(0.0003)

    sched = Scheduler(None, max_batch=8, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: 0)
    try:
        def row(k: int = 4):
            return (None, SimpleNamespace(k=k, max_new=64, tokens=[], can_speculate=k > 0,
                                          accepted=0, drafts=0, per_position=[0] * k,
                                          denc=None, draft=None, dfns=None))

        sched._costs = costs
        costs.observe_draft(1, 0.00005)
        for _ in range(20):  # the target accepts every proposal
            costs.observe_acceptance(4, [0] * 5, [0] * 5)
        assert sched._draft_lengths([row(), row()]) == [4, 4]
        assert sched._draft_lengths([row(1), row(1)]) == [1, 1]
        assert sched._draft_lengths([row(4), row(0)]) == [4, 0]  # a row without a draft
        # A row that needs one more token proposes none: nothing after it would be kept.
        near_end = row()
        near_end[1].tokens = [5] * 63
        assert sched._draft_lengths([near_end, row()]) == [0, 4]
        # Rows whose draft encoder has not run pay for it in the step that first speculates.
        costs.observe_draft_encoder(1.0)
        assert sched._draft_lengths([row(), row()]) == [0, 0]
        encoded = [row(), row()]
        for _job, state in encoded:
            state.denc = object()
        assert sched._draft_lengths(encoded) == [4, 4]
        for _ in range(400):  # now the target rejects every first proposal
            costs.observe_acceptance(0, [0] * 5, [1] * 5)
        assert sched._draft_lengths([row(), row()]) == [0, 0]  # direct pays
        assert sched._draft_lengths([row()]) == [4]  # alone: as unbatched (its own k)
    finally:
        sched.close()


def _turn_rows(n: int, *, synthetic_first: bool = False) -> list:
    """Return n rows (job, state) as the turn rule reads them."""
    from types import SimpleNamespace

    return [(SimpleNamespace(synthetic=synthetic_first and i == 0), SimpleNamespace())
            for i in range(n)]


def _row_costs(one_row_s: float, gain: float):
    """Return measured steps where B rows emit one token each in one_row_s * B / gain(B)
    seconds (gain: rows per second over one row's; 1: sharing a step gains nothing)."""
    from engine.scheduler import TURN_ROWS, RowTokenCosts

    class Measured(RowTokenCosts):
        def observe(self, rows: int, seconds: float, tokens: int) -> None:
            pass  # these costs, whatever the loop measures

    costs = Measured()
    for b in range(1, TURN_ROWS + 2):
        RowTokenCosts.observe(costs, b, one_row_s * b / (1 + (gain - 1) * (b - 1) / TURN_ROWS),
                              b)
    return costs


def test_step_costs_by_rows_are_seconds_until_every_row_has_a_token():
    from engine.scheduler import RowTokenCosts

    costs = RowTokenCosts()
    assert costs.row_token_s(2) is None
    costs.observe(2, 0.010, 4)  # two rows, two tokens each (verified proposals)
    assert costs.row_token_s(2) == pytest.approx(0.005)
    for _ in range(60):  # smoothed: follows a change within a few steps
        costs.observe(2, 0.020, 2)
    assert costs.row_token_s(2) == pytest.approx(0.020, rel=1e-3)


def test_rows_take_turns_where_sharing_a_step_does_not_pay(monkeypatch):
    from engine.scheduler import TURN_ROWS, Scheduler

    monkeypatch.setattr(scheduler_module, "EXPLORE_EVERY", 10**9)  # no exploring
    waiting = [0]
    sched = Scheduler(None, max_batch=8, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: waiting[0])
    try:
        # Nothing measured yet: every row steps (the steps that measure).
        rows = _turn_rows(2)
        assert sched._turn(rows) is None
        # A step over B rows costs about what the rows cost one at a time (a CPU's
        # products): one row after another, the rows' finish times sum lower.
        sched._row_costs = _row_costs(0.01, gain=1.2)
        for n in range(2, TURN_ROWS + 1):
            rows = _turn_rows(n)
            assert sched._turn(rows) is rows[0], n
        # A probe's row makes way: the oldest real row takes the turn.
        rows = _turn_rows(3, synthetic_first=True)
        assert sched._turn(rows) is rows[1]
        # More rows than TURN_ROWS: a load near one row at a time's, the batch steps.
        assert sched._turn(_turn_rows(TURN_ROWS + 1)) is None
        # A caller waiting for a row: throughput first.
        waiting[0] = 1
        rows = _turn_rows(2)
        assert sched._turn(rows) is None
        waiting[0] = 0
        sched.turns = False
        assert sched._turn(rows) is None
        sched.turns = True
        assert sched._turn(rows) is rows[0]
        # Where a step of B rows costs little more than one row's (its weight reads), as on
        # a GPU, the rows share the step.
        sched._row_costs = _row_costs(0.01, gain=TURN_ROWS * 0.9)
        assert sched._turn(rows) is None
    finally:
        sched.close()


def test_one_turn_in_explore_every_is_taken_together():
    from engine.scheduler import EXPLORE_EVERY, Scheduler

    sched = Scheduler(None, max_batch=8, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: 0)
    try:
        sched._row_costs = _row_costs(0.01, gain=1.0)
        rows = _turn_rows(2)
        turns = []
        for _ in range(2 * EXPLORE_EVERY):  # one step a pass of the loop
            sched._passes += 1
            turns.append(sched._turn(rows))
        assert sum(turn is None for turn in turns) == 2  # t(2) stays measured
    finally:
        sched.close()


def test_one_held_arrival_in_explore_every_is_taken_up_for_a_step_that_runs_together():
    from types import SimpleNamespace

    from engine.scheduler import EXPLORE_EVERY, Scheduler

    sched = Scheduler(None, max_batch=8, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: 0)
    try:
        sched._row_costs = _row_costs(0.01, gain=1.0)
        running = (SimpleNamespace(synthetic=False, alone=False), SimpleNamespace())
        sched._active = [running]

        def passes(arrivals: list) -> list[tuple[bool, bool]]:
            """Run a pass of the loop (take, then step) per arrival; each pass: (taken up,
            stepped together)."""
            steps = []
            for arrival in arrivals:
                sched._passes += 1
                sched._inbox.append(arrival)
                taken = sched._take()
                turn = sched._turn([running, *((job, SimpleNamespace()) for job in taken)])
                steps.append((bool(taken), turn is None))
                sched._inbox.clear()
            return steps

        def arrival() -> SimpleNamespace:
            return SimpleNamespace(synthetic=False, alone=False, turn_chosen=False)

        # New arrivals beside a running row: one in EXPLORE_EVERY is taken up to explore,
        # for a step that runs together (its encoder never runs to wait its turn after).
        steps = passes([arrival() for _ in range(2 * EXPLORE_EVERY)])
        assert steps.count((True, True)) == 2 and steps.count((True, False)) == 0
        # An arrival held made its choice once: the passes it waits are no new draws.
        held = arrival()
        assert passes([held] * (2 * EXPLORE_EVERY)) == [(False, True)] * (2 * EXPLORE_EVERY)
        assert held.turn_chosen
    finally:
        sched._active = []  # not the loop's to fail at close
        sched.close()


def test_rows_taking_turns_stay_exact_and_the_wait_is_the_requests_batch_wait(
        tmp_path, tiny_dirs, alone, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    from engine.runtime import _batch_fields

    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(3, seed=47, overflow=False)
    try:
        sched = rt._scheduler
        monkeypatch.setattr(scheduler_module, "EXPLORE_EVERY", 10**9)  # no exploring
        jobs = [make_job(rt, t, row, max_new=m) for row, (t, m) in
                enumerate(zip(texts, (12, 20, 8), strict=True))]
        order: list[Job] = []
        sched.recorder = _Order(order)
        jobs[0].first_token = Handshake()
        submit_together(rt, jobs)
        jobs[0].first_token.wait()  # nothing measured yet: all three joined and stepped
        sched._row_costs = _row_costs(0.01, gain=1.0)  # a step costs its rows one at a time
        jobs[0].first_token.go.set()
        for job, text in zip(jobs, texts, strict=True):
            assert tuple(sched.wait(job).tokens) == alone(text, job.max_new), text
        # After that step, one row at a time, oldest first, the others waiting their turn;
        # their waits are what they report as batch_wait_s.
        assert order[:3] == jobs and [job.batch_max for job in jobs] == [3, 3, 3]
        assert order[3:] == sorted(order[3:], key=jobs.index)
        assert jobs[0].turn_s == 0 < jobs[1].turn_s < jobs[2].turn_s
        assert sched.turn_steps == jobs[0].steps - 1 + jobs[1].steps - 1
        assert rt.batch_snapshot().turn_steps == sched.turn_steps
        for job in jobs:
            fields = _batch_fields(job, job.t_picked)
            assert fields["batch_wait_s"] == job.turn_s
    finally:
        rt.close()


def test_an_arrival_that_would_wait_its_turn_waits_unencoded_in_the_queue(
        tmp_path, tiny_dirs, alone, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    from engine.runtime import _batch_fields

    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(3, seed=53, overflow=False)
    try:
        sched = rt._scheduler
        sched._row_costs = _row_costs(0.01, gain=1.0)  # a step costs its rows one at a time
        monkeypatch.setattr(scheduler_module, "EXPLORE_EVERY", 10**9)  # no exploring
        running = make_job(rt, texts[0], 0, max_new=24)
        running.first_token = Handshake()
        sched.submit(running)
        running.first_token.wait()  # the loop holds after its first token
        later = [make_job(rt, t, row, max_new=12) for row, t in ((1, texts[1]), (2, texts[2]))]
        submit_together(rt, later)
        running.first_token.go.set()
        for job, text in zip([running, *later], texts, strict=True):
            assert tuple(sched.wait(job).tokens) == alone(text, job.max_new), text
        # Each arrival was taken up (its encoder run) only once the row ahead had left:
        # first come, first served, as one decode stream serves, each row stepping alone.
        assert running.t_encoded < running.decoded.stamps[-1] <= later[0].t_picked
        assert later[0].decoded.stamps[-1] <= later[1].t_picked
        assert [job.batch_max for job in [running, *later]] == [1, 1, 1]
        assert all(job.turn_s == 0 for job in [running, *later])
        assert sched.turn_steps >= running.steps - 1  # while the arrivals waited
        for job in later:  # the wait is the request's batch_wait_s
            fields = _batch_fields(job, job.t_submitted)
            assert fields["batch_wait_s"] == job.t_picked - job.t_submitted > 0
    finally:
        rt.close()


class _Order(StepRecorder):
    """A recorder that lists the jobs of every step in order."""

    def __init__(self, order: list[Job]) -> None:
        super().__init__()
        self.order = order

    def stepped(self, phase, seconds, jobs) -> None:
        super().stepped(phase, seconds, jobs)
        self.order.extend(jobs)


def test_drafts_proposing_together_cost_one_call_a_draft_step_in_the_choice():
    from types import SimpleNamespace

    from engine.scheduler import Scheduler, StepCosts

    costs = StepCosts()
    # Each draft step's call over the rows still proposing: fixed + per position.
    for n in (8, 2, 8, 2):
        costs.observe_draft_call(n, 0.0001 + n * 0.00001)
    assert costs.draft_seconds([4, 2], batched=True) == pytest.approx(4 * 0.0001 + 6 * 0.00001)
    costs.observe_draft(6, 0.06)  # drafts proposing alone: seconds per proposal
    assert costs.draft_seconds([4, 2], batched=False) == pytest.approx(0.06)
    assert StepCosts().draft_seconds([4], batched=True) is None  # nothing measured

    sched = Scheduler(None, max_batch=8, window_max_s=0.0,  # type: ignore[arg-type]
                      waiting=lambda: 0)
    try:
        native_step = object()
        on_c = SimpleNamespace(native=native_step)

        def row(draft: object = on_c):
            return (None, SimpleNamespace(
                k=4, max_new=64, tokens=[], can_speculate=True, accepted=0, drafts=0,
                per_position=[0] * 4, denc=object(), draft=draft,
                dfns=SimpleNamespace(step=native_step)))

        sched._costs = costs
        for n in (8, 40, 8, 40):
            costs.observe(n, 0.001 + n * 0.0003)
        for _ in range(20):
            costs.observe_acceptance(4, [0] * 5, [0] * 5)
        # Proposals at 10 ms each (as measured alone) cost more than they save; made
        # together, one call a draft step, they pay.
        assert sched._draft_lengths([row(), row()]) == [4, 4]
        sched.batch_drafts = False
        assert sched._draft_lengths([row(), row()]) == [0, 0]
        sched.batch_drafts = True
        off_c = SimpleNamespace(native=None)  # a draft not on the C step proposes alone
        assert sched._draft_lengths([row(), row(off_c)]) == [0, 0]
    finally:
        sched.close()


class _Interrupted(BaseException):
    """What interrupts a waiting caller (as KeyboardInterrupt would)."""


class _InterruptOnce(threading.Event):
    """A done event whose first wait() is interrupted (after the row's first token)."""

    def __init__(self, first_token: threading.Event) -> None:
        super().__init__()
        self._first_token = first_token
        self._interrupted = False

    def wait(self, timeout: float | None = None) -> bool:
        if not self._interrupted:
            self._interrupted = True
            self._first_token.wait()
            raise _Interrupted
        return super().wait(timeout)


class _UntilCancelled(StepRecorder):
    """A recorder that holds the loop after each step of `job` until it is cancelled, so the
    row cannot finish between its caller's interruption and the cancel (a loaded host)."""

    def __init__(self) -> None:
        super().__init__()
        self.job: Job | None = None

    def stepped(self, phase, seconds, jobs) -> None:
        super().stepped(phase, seconds, jobs)
        if self.job in jobs and not self.job.cancelled.wait(timeout=60):
            raise AssertionError("the interrupted caller never cancelled its row")


def test_an_interrupted_wait_returns_only_once_its_row_has_left(tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=2)
    texts = random_texts(3, seed=43, overflow=False)
    try:
        keep, drop = make_job(rt, texts[0], 0, max_new=40), make_job(rt, texts[1], 1, max_new=40)
        hold = rt._scheduler.recorder = _UntilCancelled()
        hold.job = drop
        drop.done = _InterruptOnce(drop.first_token)
        submit_together(rt, [keep, drop])
        with pytest.raises(_Interrupted):
            rt._scheduler.wait(drop)
        # Its admission slot may go to the next caller now: the row is out of the batch.
        assert drop.done.is_set() and isinstance(drop.error, Cancelled)
        assert all(job is not drop for job, _state in rt._scheduler._active)
        again = make_job(rt, texts[2], 1, max_new=16)
        rt._scheduler.submit(again)
        assert tuple(rt._scheduler.wait(again).tokens) == alone(texts[2], 16)
        assert tuple(rt._scheduler.wait(keep).tokens) == alone(texts[0], 40)
    finally:
        rt.close()


class _FailingRecorder(StepRecorder):
    """A recorder whose first step fails: an error that is no one row's."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def stepped(self, phase, seconds, jobs) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("recorder broken")
        super().stepped(phase, seconds, jobs)


def test_an_error_that_is_no_rows_fails_that_steps_rows_and_the_loop_goes_on(
        tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=2)
    texts = random_texts(3, seed=47, overflow=False)
    try:
        rt._scheduler.recorder = _FailingRecorder()
        jobs = [make_job(rt, t, row) for row, t in enumerate(texts[:2])]
        submit_together(rt, jobs)
        for job in jobs:
            with pytest.raises(OSError, match="recorder broken"):
                rt._scheduler.wait(job)
        assert rt._scheduler.thread.is_alive()
        assert rt.generate(texts[2], max_new_tokens=16).output_ids == alone(texts[2])
    finally:
        rt.close()


def test_waiting_real_jobs_join_before_synthetic_ones(tmp_path, tiny_dirs, alone):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4)
    texts = random_texts(4, seed=53, overflow=False)
    try:
        # Jobs that run alone run one at a time, so the order they join is the order the
        # loop took them: the real one, last to arrive, goes first.
        jobs = [make_job(rt, t, row, max_new=8) for row, t in enumerate(texts[:3])]
        for job, synthetic in zip(jobs, (True, True, False), strict=True):
            job.alone, job.synthetic = True, synthetic
        submit_together(rt, jobs)
        for job, text in zip(jobs, texts[:3], strict=True):
            assert tuple(rt._scheduler.wait(job).tokens) == alone(text, 8)
        assert jobs[2].t_picked < jobs[0].t_picked < jobs[1].t_picked
        # A synthetic job that runs alone does not hold back a real one behind it: the
        # real one joins the batch and the synthetic one waits for it to empty.
        probe, user = make_job(rt, texts[0], 0, max_new=8), make_job(rt, texts[3], 1, max_new=8)
        probe.alone, probe.synthetic = True, True
        submit_together(rt, [probe, user])
        assert tuple(rt._scheduler.wait(probe).tokens) == alone(texts[0], 8)
        assert tuple(rt._scheduler.wait(user).tokens) == alone(texts[3], 8)
        assert user.t_picked < probe.t_picked and probe.batch_max == 1
    finally:
        rt.close()


@pytest.mark.parametrize("k", [0, 3])
def test_a_row_failing_the_c_steps_joint_call_fails_alone(tmp_path, tiny_dirs, alone,
                                                           monkeypatch, k):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(3, seed=59, overflow=False)

    def spoil(state):  # its target's cross K/V has the wrong width: the joint call fails
        state.tenc = narrow_cross(state.tenc, c_step=True)

    start_row = break_row(rt, monkeypatch, spoil)
    try:
        rt._scheduler._costs = _Favour(speculate=bool(k))
        jobs = [make_job(rt, t, row, k=k, max_new=20) for row, t in enumerate(texts)]
        submit_together(rt, jobs)
        with pytest.raises(BoundaryError):
            rt._scheduler.wait(jobs[1])
        for i in (0, 2):  # each row alone after the joint call failed: exact
            assert tuple(rt._scheduler.wait(jobs[i]).tokens) == alone(texts[i], 20)
        monkeypatch.setattr(rt.rows, "start_row", start_row)
        assert rt.generate(texts[1], max_new_tokens=20).output_ids == alone(texts[1], 20)
    finally:
        rt.close()
