"""Arrivals of one bucket encoded together (engine.group_encode): one encoder call for the
requests the loop takes at once, and every request's tokens still what it decodes alone."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import decoding, native, t5
from engine.errors import Cancelled
from engine.runtime import Runtime
from tests.engine.batching import make_job, submit_together
from tests.engine.conftest import batching_runtime, random_texts


def _count_encoders(rt: Runtime, monkeypatch) -> tuple[list[list[int]], list[int]]:
    """Record the padded lengths of each grouped call, and of each target input encoded
    alone."""
    grouped: list[list[int]] = []
    single: list[int] = []
    encode_rows, encode = rt.rows.encode_rows, decoding.encode

    def counted_rows(jobs):
        grouped.append([job.length for job in jobs])
        return encode_rows(jobs)

    def counted(runner, fns, ids, mask):
        if runner is rt.target:
            single.append(ids.shape[1])
        return encode(runner, fns, ids, mask)

    monkeypatch.setattr(rt.rows, "encode_rows", counted_rows)
    monkeypatch.setattr(decoding, "encode", counted)
    return grouped, single


@pytest.mark.parametrize("native_step", [True, False])
@pytest.mark.parametrize("speculate", [False, True])
def test_arrivals_taken_together_are_encoded_in_one_call_per_bucket_and_stay_exact(
        tmp_path, tiny_dirs, alone, monkeypatch, native_step, speculate):
    if native_step and native._compiler() is None:
        pytest.skip("no C compiler")
    # turns=False: a turn takes one arrival up at a time, and whether rows take turns is
    # chosen from measured step times; this test is about which arrivals share a call.
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=8,
                          native_step=native_step)
    try:
        assert rt.target.group_edges == {16, 32}  # 8 tokens: below GROUP_MIN_LENGTH
        grouped, single = _count_encoders(rt, monkeypatch)
        texts = random_texts(11, seed=61)  # buckets 8, 16, 32 and the overflow, in turn
        first = [make_job(rt, t, row, max_new=m, k=(2 if speculate and row % 3 else 0))
                 for row, (t, m) in enumerate(zip(texts[:8], (40, 5, 12, 3, 9, 40, 7, 16),
                                                  strict=True))]
        submit_together(rt, first)
        for job in first[1:5]:
            rt._scheduler.wait(job)
        # Later arrivals join the running batch, a group of their own.
        later = [make_job(rt, t, row, max_new=16, k=2 if speculate else 0)
                 for row, t in zip((1, 2, 3), texts[1::4], strict=True)]
        submit_together(rt, later)
        pairs = [*zip(first, texts, strict=False), *zip(later, texts[1::4], strict=True)]
        for job, text in pairs:
            got = rt._scheduler.wait(job).tokens
            assert tuple(got) == alone(text, job.max_new), text
        # One call per bucket of 9 tokens and up; the 8-token and exact inputs alone.
        assert sorted(map(sorted, grouped)) == [[16, 16], [16, 16, 16], [32, 32]]
        assert sorted(single) == sorted(j.length for j in first if j.length not in (16, 32))
        assert rt.batch_snapshot().step_count["encode"] == 11
    finally:
        rt.close()


def test_a_cancelled_arrival_is_not_encoded_and_changes_no_one(tmp_path, tiny_dirs, alone,
                                                              monkeypatch):
    rt = batching_runtime(tmp_path, tiny_dirs, turns=False, max_batch=4)
    try:
        grouped, single = _count_encoders(rt, monkeypatch)
        texts = random_texts(12, seed=71, overflow=False)[1::3]  # four of bucket 16
        jobs = [make_job(rt, t, row) for row, t in enumerate(texts)]
        assert {job.length for job in jobs} == {16}
        jobs[1].cancel()
        submit_together(rt, jobs)
        with pytest.raises(Cancelled):
            rt._scheduler.wait(jobs[1])
        for i in (0, 2, 3):
            assert tuple(rt._scheduler.wait(jobs[i]).tokens) == alone(texts[i])
        assert grouped == [[16, 16, 16]] and single == []
    finally:
        rt.close()


def test_a_failing_grouped_encode_falls_back_so_only_the_failing_request_errors(
        tmp_path, tiny_dirs, alone, monkeypatch):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=4, native_step=False)
    try:
        calls: list[int] = []
        start_row = rt.rows.start_row

        def grouped_fails(jobs):
            calls.append(len(jobs))
            raise RuntimeError("grouped encoder failed")

        def third_fails(job, tenc=None):
            if job.row == 2:
                raise ValueError("this request's own encoder failed")
            return start_row(job, tenc)

        monkeypatch.setattr(rt.rows, "encode_rows", grouped_fails)
        monkeypatch.setattr(rt.rows, "start_row", third_fails)
        texts = random_texts(12, seed=73, overflow=False)[2::3]  # four of bucket 32
        jobs = [make_job(rt, t, row) for row, t in enumerate(texts)]
        submit_together(rt, jobs)
        with pytest.raises(ValueError):
            rt._scheduler.wait(jobs[2])
        for i in (0, 1, 3):
            assert tuple(rt._scheduler.wait(jobs[i]).tokens) == alone(texts[i])
        assert calls == [4]
    finally:
        rt.close()


def test_a_grouped_encoder_not_bitwise_the_batch_1_one_is_not_used(tmp_path, tiny_dirs,
                                                                   monkeypatch, caplog):
    encode_batch = t5.encode_batch

    def off_by_a_bit(m, ids, mask_bias, enc_bias):
        out = encode_batch(m, ids, mask_bias, enc_bias)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    rt = batching_runtime(tmp_path, tiny_dirs, warm=False, max_batch=4)
    try:
        monkeypatch.setattr(t5, "encode_batch", off_by_a_bit)
        with caplog.at_level(logging.WARNING, logger="engine.group_encode"):
            rt.warm_up(background=False)
        assert rt.target.group_edges == set() and rt.target.group_off is not None
        assert len([r for r in caplog.records if r.name == "engine.group_encode"]) == 1
    finally:
        rt.close()


def test_an_unbatched_engine_groups_nothing(tmp_path, tiny_dirs):
    rt = batching_runtime(tmp_path, tiny_dirs, max_batch=1)
    try:
        assert rt.target.group_edges == set()
    finally:
        rt.close()
