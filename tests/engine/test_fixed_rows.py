"""The fixed-row compiled step (engine.t5.decode_fixed on engine.row_buffers): batched rows
on a compiled step without the C step decode, lane for lane, what each decodes alone, in
graphs the warm-up compiled for every batch-size class."""

from __future__ import annotations

import pytest
import torch

from engine import t5
from engine.errors import Cancelled
from engine.protocol import FlagOverride
from engine.row_buffers import RowBuffers, batch_sizes
from engine.runtime import Runtime
from tests.engine.batching import Handshake, make_job, submit_together
from tests.engine.conftest import batching_runtime, build_tiny_t5, random_texts, tiny_config

DIRECT = FlagOverride(speculative=False)


def test_batch_size_classes_are_powers_of_two_and_the_largest():
    assert batch_sizes(1) == ()
    assert batch_sizes(2) == (2,)
    assert batch_sizes(6) == (2, 4, 6)
    assert batch_sizes(8) == (2, 4, 8)


@pytest.mark.parametrize("backend", ["eager", "aot_eager",
                                     pytest.param("inductor", marks=pytest.mark.slow)])
# torch 2.13 inductor touches torch.jit.script_method, which warns; pytest makes warnings errors.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_lanes_of_mixed_buckets_and_positions_equal_each_row_alone(tmp_path, backend):
    model = build_tiny_t5(tmp_path / "m", seed=5, d_model=20, heads=2)
    rt = Runtime(tiny_config({"target": model, "draft": model}, use_draft=False,
                             compile_backend=backend, cache_dir=str(tmp_path / "cache"),
                             native_step=False, max_batch=4))
    try:
        r, m = rt.target, rt.target.m
        buffers = rt.rows.buffers["target"]
        assert buffers.fixed and buffers.sizes == (2, 4)
        fixed = r.compiled(8).rows
        gen = torch.Generator().manual_seed(1)
        # Stale K/V in every slot of every row (the masking, not zeros, keeps them out).
        buffers.self_kv.copy_(torch.randn(buffers.self_kv.shape, generator=gen))
        rows, lengths, where = [2, 0, 3], [8, 32, 16], [0, 7, r.slots - 1]
        crosses, masks = [], []
        for row, length in zip(rows, lengths, strict=True):
            crosses.append(torch.randn((len(m.dec_layers), 2, m.n_heads, length, m.d_kv),
                                       generator=gen))
            keep = torch.ones((1, length), dtype=torch.long)
            keep[0, length - length // 4:] = 0  # bucket padding, masked
            masks.append(m.mask_bias(keep))
            buffers.load(row, crosses[-1], masks[-1])
        before = buffers.self_kv.clone()
        tokens = [40, 77, 3]
        with torch.no_grad():
            # Three rows: the class of four, its last lane on the scratch row.
            got = buffers.step(fixed, m, rows, tokens, where, r.dec_bias)
            alone_caches = [before[row].clone() for row in rows]
            alone = [t5.decode_steps(m, torch.tensor([[tok]]), r.positions[p], cache, cross,
                                     mask, r.bias_for(p + 1), 1).item()
                     for tok, p, cache, cross, mask in zip(tokens, where, alone_caches,
                                                           crosses, masks, strict=True)]
            eager_rows = t5.decode_rows(m, torch.tensor(tokens), torch.tensor(where),
                                        [before[row].clone() for row in rows], crosses, masks,
                                        r.dec_bias).tolist()
        assert got == alone == eager_rows
        assert len(set(alone)) > 1  # the rows steer their tokens
        for row, cache in zip(rows, alone_caches, strict=True):
            torch.testing.assert_close(buffers.self_kv[row], cache, rtol=1e-5, atol=1e-5)
        assert torch.equal(buffers.self_kv[1], before[1])  # a row in no lane: untouched
    finally:
        rt.close()


def _runtime(tmp_path, dirs, **changes) -> Runtime:
    return batching_runtime(tmp_path, dirs, **{"native_step": False, **changes})


def _count_fixed_steps(rt: Runtime, monkeypatch) -> list[int]:
    """Record the rows of every fixed-row step the loop runs on the target's buffers."""
    buffers = rt.rows.buffers["target"]
    step = buffers.step
    calls: list[int] = []

    def counted(fn, m, rows, *args):
        calls.append(len(rows))
        return step(fn, m, rows, *args)

    monkeypatch.setattr(buffers, "step", counted)
    return calls


@pytest.fixture(scope="module")
def alone(tmp_path_factory, tiny_dirs):
    """Return a function giving a text's tokens decoded alone by an unbatched engine."""
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", max_batch=1,
                             cache_dir=str(tmp_path_factory.mktemp("alone") / "cache")))
    rt.warm_up(background=False)
    memo: dict[tuple[str, int], tuple[int, ...]] = {}

    def tokens(text: str, max_new: int = 16) -> tuple[int, ...]:
        if (text, max_new) not in memo:
            memo[(text, max_new)] = rt.generate(text, max_new_tokens=max_new,
                                                override=DIRECT).output_ids
        return memo[(text, max_new)]

    yield tokens
    rt.close()


def test_rows_joining_and_leaving_on_the_fixed_row_step_decode_what_they_decode_alone(
        tmp_path, tiny_dirs, alone, monkeypatch):
    rt = _runtime(tmp_path, tiny_dirs, turns=False, max_batch=4)
    try:
        calls = _count_fixed_steps(rt, monkeypatch)
        sched = rt._scheduler
        texts = random_texts(7, seed=21, overflow=False)  # every bucket
        first = [make_job(rt, t, row, max_new=m, k=k) for row, (t, m, k) in
                 enumerate(zip(texts[:4], (40, 5, 12, 3), (0, 2, 0, 0), strict=True))]
        submit_together(rt, first)
        first[0].first_token.wait()
        for job in first[1:]:
            sched.wait(job)
        later = [make_job(rt, t, row, max_new=m) for row, (t, m) in
                 zip((1, 2, 3), zip(texts[4:7], (7, 40, 9), strict=True), strict=True)]
        submit_together(rt, later)
        for job, text in zip(first + later, texts, strict=True):
            got = sched.wait(job).tokens
            assert tuple(got) == alone(text, job.max_new), text
        assert first[0].batch_max == 4 and all(job.joined_step > 0 for job in later)
        # Every batched direct step ran as one fixed-row call (no call per row).
        assert max(calls) == 4 and min(calls) >= 2
        assert rt.batch_snapshot().step_count["decode"] >= len(calls)
    finally:
        rt.close()


def test_the_warm_up_covers_every_batch_size_class(tmp_path, tiny_dirs, alone, monkeypatch):
    # The CUDA-graph mode on CPU: one owner thread, and the ledger counts what a GPU would
    # record; a call after warm-up with a shape or buffer it did not see is a recording.
    rt = _runtime(tmp_path, tiny_dirs, max_batch=4, compile_mode="reduce-overhead")
    try:
        assert rt.rows.buffers["target"].sizes == (2, 4)
        calls = _count_fixed_steps(rt, monkeypatch)
        compiled = rt.compile_snapshot()
        texts = random_texts(5, seed=23, overflow=False)
        three = [make_job(rt, t, row, max_new=m) for row, (t, m) in
                 enumerate(zip(texts[:3], (16, 10, 4), strict=True))]
        submit_together(rt, three)  # three rows: the class of four
        for job in three:
            rt._scheduler.wait(job)
        two = [make_job(rt, t, row, max_new=12) for row, t in enumerate(texts[3:])]
        submit_together(rt, two)  # two rows: the class of two
        for job, text in zip(three + two, texts, strict=True):
            assert tuple(rt._scheduler.wait(job).tokens) == alone(text, job.max_new), text
        assert 3 in calls and 2 in calls
        snap = rt.graph_snapshot()
        assert snap.recorded_after_warmup == 0 and snap.off_owner_calls == 0
        after = rt.compile_snapshot()
        assert (after.graphs, after.recompiles) == (compiled.graphs, compiled.recompiles)
    finally:
        rt.close()


def test_a_cancelled_row_mid_batch_changes_no_other_rows_output(tmp_path, tiny_dirs, alone,
                                                                monkeypatch):
    rt = _runtime(tmp_path, tiny_dirs, max_batch=3)
    texts = random_texts(4, seed=13, overflow=False)
    try:
        calls = _count_fixed_steps(rt, monkeypatch)
        keep = [make_job(rt, texts[0], 0, max_new=40), make_job(rt, texts[2], 2, max_new=30)]
        drop = make_job(rt, texts[1], 1, max_new=40)
        drop.first_token = Handshake()
        submit_together(rt, [keep[0], drop, keep[1]])
        drop.first_token.wait()
        drop.cancel()  # while the loop waits: it lands mid-answer on any timing
        drop.first_token.go.set()
        with pytest.raises(Cancelled):
            rt._scheduler.wait(drop)
        # Its row is free: another request takes it while the others still run.
        again = make_job(rt, texts[3], 1, max_new=16)
        rt._scheduler.submit(again)
        for job, text in zip([*keep, again], (texts[0], texts[2], texts[3]), strict=True):
            assert tuple(rt._scheduler.wait(job).tokens) == alone(text, job.max_new), text
        assert 3 in calls  # the three shared fixed-row steps before the cancel
    finally:
        rt.close()


def test_the_kv_account_counts_the_buffers_as_allocated(tmp_path, tiny_dirs):
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", native_step=False,
                             max_batch=3, cache_dir=str(tmp_path / "cache")))
    try:
        m, slots = rt.target.m, rt.slots
        per_slot = len(m.dec_layers) * 2 * m.n_heads * m.d_kv * 4  # float32 K and V
        dm = rt.draft.m
        draft_slot = len(dm.dec_layers) * 2 * dm.n_heads * dm.d_kv * 4
        # Admission's extra row (engine.preempt_synthetic, on by default) and the scratch
        # row (the draft's rows have none).
        rows = 3 + 1 + 1
        longest = max(rt.config.buckets)
        want = ((slots + 1) * (rows * per_slot + 4 * draft_slot)  # self-attention caches
                + rows * longest * per_slot  # each row's cross K/V, padded
                + rows * longest * 4)  # each row's cross mask bias
        assert rt.memory_snapshot().kv_static_bytes == want
        # The extra row steps only while a synthetic row pauses: no batch-size class more.
        assert rt.rows.buffers["target"].sizes == batch_sizes(3) == (2, 3)
        assert isinstance(rt.rows.buffers["draft"], RowBuffers)
        assert not rt.rows.buffers["draft"].fixed  # the draft steps one row at a time
    finally:
        rt.close()


def test_the_native_step_flag_off_batches_on_the_fixed_row_step(tmp_path, tiny_dirs, alone,
                                                                monkeypatch):
    from engine import native

    if native._compiler() is None:
        pytest.skip("no C compiler")
    rt = _runtime(tmp_path, tiny_dirs, max_batch=4, native_step=True)
    try:
        assert rt.target.native is not None  # the C step serves; the flag turns it off
        buffers = rt.rows.buffers["target"]
        assert not buffers.fixed  # made on first need: a C-step engine never pays for it
        static = rt.memory_snapshot().kv_static_bytes
        calls = _count_fixed_steps(rt, monkeypatch)
        off = FlagOverride(speculative=False, native_step=False)
        texts = random_texts(5, seed=27, overflow=False)
        first = rt.generate(texts[0], max_new_tokens=16, override=off)  # warms it
        assert first.output_ids == alone(texts[0]) and not first.native_step
        assert buffers.fixed
        grown = rt.memory_snapshot().kv_static_bytes - static
        assert grown == buffers.cross.nbytes + buffers.cross_bias.nbytes
        jobs = [make_job(rt, t, row, max_new=m) for row, (t, m) in
                enumerate(zip(texts[1:5], (16, 9, 12, 5), strict=True))]
        for job in jobs:
            job.native = False  # as the flag off makes a request's job
        submit_together(rt, jobs)
        for job, text in zip(jobs, texts[1:5], strict=True):
            assert tuple(rt._scheduler.wait(job).tokens) == alone(text, job.max_new), text
        assert max(calls) == 4  # the batched steps ran as fixed-row calls
    finally:
        rt.close()
