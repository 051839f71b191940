"""The batching loop's recorder (engine.scheduler_recorder): what it derives from hand-set
steps, and that swapping in the NullRecorder stops the recording and changes no output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.protocol import STEP_SECONDS_EDGES
from engine.runtime import Runtime
from engine.scheduler_recorder import NullRecorder, StepRecorder
from tests.engine.conftest import random_texts, tiny_config


@dataclass
class _Job:
    joined_step: int = -1
    steps: int = 0
    batch_sum: int = 0


def test_the_recorder_counts_steps_by_phase_and_each_requests_batch_sizes() -> None:
    recorder = StepRecorder()
    a, b = _Job(), _Job()
    recorder.joined(a, 0.004)
    recorder.stepped("decode", 0.003, [a])
    recorder.joined(b, 0.0004)
    recorder.stepped("decode", 0.03, [a, b])
    recorder.stepped("verify", 2.0, [b])
    assert (a.joined_step, a.steps, a.batch_sum) == (0, 2, 3)
    assert (b.joined_step, b.steps, b.batch_sum) == (1, 2, 3)
    steps, count, seconds, buckets = recorder.totals()
    assert steps == 3
    assert count == {"encode": 2, "decode": 2, "verify": 1}
    assert seconds == {"encode": 0.0044, "decode": 0.033, "verify": 2.0}
    edges = list(STEP_SECONDS_EDGES)
    # Cumulative: 0.003 s counts from the 0.005 edge up, 0.03 s from the 0.05 edge.
    assert buckets["decode"] == tuple((e >= 0.005) + (e >= 0.05) for e in edges)
    assert buckets["encode"] == tuple((e >= 0.0005) + (e >= 0.005) for e in edges)
    assert buckets["verify"] == (0,) * len(edges)  # past the last edge: only +Inf


def test_the_null_recorder_records_nothing() -> None:
    recorder, job = NullRecorder(), _Job()
    recorder.joined(job, 0.01)
    recorder.stepped("decode", 0.01, [job])
    assert (job.joined_step, job.steps, job.batch_sum) == (-1, 0, 0)
    assert recorder.totals()[0] == 0


def test_a_loop_recording_nothing_decodes_what_a_recording_loop_does(tmp_path, tiny_dirs) -> None:
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", use_draft=False,
                             cache_dir=str(tmp_path / "cache"), max_batch=4))
    try:
        rt.warm_up(background=False)
        loop = rt.batch_scheduler
        assert loop is not None and type(loop.recorder) is StepRecorder  # production's
        texts = random_texts(8, seed=3, overflow=False)

        def serve() -> list:
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(rt.generate, texts))

        recorded = serve()
        steps = rt.batch_snapshot().steps
        assert steps > 0 and all(r.batch_join_step >= 0 for r in recorded)
        loop.recorder = NullRecorder()
        quiet = serve()
        snap = rt.batch_snapshot()
        assert snap.steps == 0 and sum(snap.step_count.values()) == 0
        assert all(r.batch_join_step == -1 and r.batch_size_mean == 1.0 for r in quiet)
        assert [r.output_ids for r in quiet] == [r.output_ids for r in recorded]
    finally:
        rt.close()
