"""The batching flag off (or a FlagOverride(batching=False)): a request runs with no
batch-mates, as engine.max_batch 1 would, and decodes what it decodes alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.errors import Cancelled, RequestTimeout
from engine.protocol import FlagOverride, InMemoryFlagProvider, RuntimeFlags
from engine.runtime import Runtime
from engine.scheduler import Job
from tests.engine.batching import Handshake
from tests.engine.conftest import batching_runtime, random_texts, tiny_config

DIRECT = FlagOverride(speculative=False)


def _job(rt: Runtime, text: str, row: int, *, alone: bool) -> Job:
    ids = list(rt.tokenizer(text).input_ids)
    _path, length, _key = rt.router.route(len(ids), rt._flags.read())
    return Job(ids=ids, length=length, key=None, k=0, max_new=12, deadline=None,
               quantized=False, row=row, alone=alone)


def test_a_job_that_runs_alone_never_shares_a_step(tmp_path, tiny_dirs):
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=4)
    try:
        sched = rt._scheduler
        assert sched is not None
        texts = random_texts(4, seed=31)
        # Two batched, then two alone: arrival order holds (an alone job waits for an empty
        # batch, and the jobs behind it wait for it).
        jobs = [_job(rt, t, i, alone=i >= 2) for i, t in enumerate(texts)]
        with sched._cond:  # the loop sees all four at once
            for job in jobs:
                sched.submit(job)
        decoded = [sched.wait(job) for job in jobs]
        for job in jobs:
            if job.alone:
                assert job.batch_max == 1 and job.batch_sum == job.steps
        # The two batched jobs joined together and stepped together.
        assert jobs[0].batch_max == jobs[1].batch_max == 2
        unbatched = batching_runtime(tmp_path / "one", tiny_dirs, max_batch=1)
        try:
            for text, d in zip(texts, decoded, strict=True):
                assert tuple(d.tokens) == unbatched.generate(
                    text, max_new_tokens=12, override=DIRECT).output_ids
        finally:
            unbatched.close()
    finally:
        rt.close()


class _NotesWhetherRunning(threading.Event):
    """A done event that notes, when it is set, whether `other` was still running."""

    def __init__(self, other: Job) -> None:
        super().__init__()
        self.other = other
        self.other_running: bool | None = None

    def set(self) -> None:
        self.other_running = not self.other.done.is_set()
        super().set()


@pytest.mark.parametrize("leaves", ["cancelled", "past its deadline"])
def test_a_job_waiting_behind_one_that_runs_alone_leaves_without_waiting_for_it(
        tmp_path, tiny_dirs, leaves):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4)
    try:
        sched = rt._scheduler
        assert sched is not None
        texts = random_texts(2, seed=31)
        solo, waiting = _job(rt, texts[0], 0, alone=True), _job(rt, texts[1], 1, alone=False)
        solo.first_token = Handshake()
        waiting.done = _NotesWhetherRunning(solo)
        sched.submit(solo)
        solo.first_token.wait()
        sched.submit(waiting)  # no one joins while `solo` runs: it waits in the inbox
        if leaves == "cancelled":
            waiting.cancel()
        else:
            waiting.deadline = 0.0
        solo.first_token.go.set()
        with pytest.raises(Cancelled if leaves == "cancelled" else RequestTimeout):
            sched.wait(waiting)
        # It left at the next step boundary, its caller's slot free while `solo` still ran.
        assert waiting.done.other_running and waiting.joined_step == -1
        assert len(sched.wait(solo).tokens) >= 1
    finally:
        rt.close()


def test_the_batching_flag_and_override_reach_the_loop(tmp_path, tiny_dirs):
    flags = InMemoryFlagProvider()
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager",
                             cache_dir=str(tmp_path / "cache"), max_batch=4), flags=flags)
    rt.warm_up(background=False)
    try:
        texts = random_texts(6, seed=32)

        def run(override: FlagOverride) -> list[int]:
            with ThreadPoolExecutor(len(texts)) as pool:
                results = list(pool.map(lambda t: rt.generate(
                    t, max_new_tokens=12, override=override), texts))
            return [r.batch_size_max for r in results]

        assert run(FlagOverride(speculative=False, batching=False)) == [1] * len(texts)
        flags.set(RuntimeFlags(batching=False))
        assert run(DIRECT) == [1] * len(texts)
    finally:
        rt.close()


def test_the_batching_flag_off_limits_admission_to_one_row_and_an_override_does_not(
        tmp_path, tiny_dirs):
    flags = InMemoryFlagProvider()
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager",
                             cache_dir=str(tmp_path / "cache"), max_batch=4), flags=flags)
    rt.warm_up(background=False)
    try:
        text = random_texts(1, seed=33)[0]
        rt.generate(text, max_new_tokens=4, override=FlagOverride(batching=False))
        assert rt._admission.limit == 4  # the burst's unbatched arm limits only itself
        flags.set(RuntimeFlags(batching=False))
        rt.generate(text, max_new_tokens=4)
        # As max_batch 1: the callers after the one row wait in admission's bounded
        # queue (429 past max_queue), not in the loop's inbox.
        assert rt._admission.limit == 1
        flags.set(RuntimeFlags())
        rt.generate(text, max_new_tokens=4)
        assert rt._admission.limit == 4
    finally:
        rt.close()
