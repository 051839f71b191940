"""Compile behaviour read from torch's own counters: no recompiles after warm-up."""

from __future__ import annotations

import random

import torch

from engine import t5
from engine.protocol import PATH_COMPILED, PATH_EAGER, PATH_OVERFLOW, FlagOverride
from tests.engine.conftest import BUCKETS, CAP, WARM_GRAPHS, random_texts, tiny_config


def test_replay_after_warmup_compiles_nothing(warm_engine, flags):
    before = warm_engine.compile_snapshot()
    # target encode (the steps and the verification run in C, engine.native; the draft's
    # encoder runs eager): one graph, shared by every bucket (the length is dynamic)
    assert warm_engine.step_kind == "target native, draft native"
    assert WARM_GRAPHS["warm_engine"] == 1, before
    # ... its attention fused, the graph traces the target's (the function HF is matched by)
    models = warm_engine.models
    assert models.draft.compiled(BUCKETS[0]).encode is t5.encode_fused
    assert models.target.compiled(BUCKETS[0]).encode is not t5.encode_fused
    texts = random_texts(210, seed=5)
    rng = random.Random(5)
    paths = set()
    for text in texts:
        spec = rng.random() < 0.5
        r = warm_engine.generate(text, max_new_tokens=rng.randint(1, 12),
                                 override=FlagOverride(speculative=spec))
        paths.add(r.path)
    after = warm_engine.compile_snapshot()
    delta = after.diff(before)
    assert paths == {PATH_COMPILED, PATH_OVERFLOW}
    assert delta.recompiles == 0 and delta.graphs == 0, delta
    assert delta.recompile_limit_hits == 0 and delta.compile_failures == 0
    assert after.graph_breaks == before.graph_breaks


def test_the_compiled_step_compiles_once_outside_the_admission_slot(warm_engine, flags,
                                                                    monkeypatch):
    """The native_step flag off (the policy's fallback, the compiled_step A/B arm): its
    graphs compile once, before the request takes a row (real requests do not queue
    behind a compile), length-dynamic: no recompile in any other bucket."""
    rows_held: list[int] = []
    warm = warm_engine.target.warm_compiled_step

    def spy(edge: int, *, verify: bool) -> None:
        rows_held.append(warm_engine._admission.running)
        warm(edge, verify=verify)

    monkeypatch.setattr(warm_engine.target, "warm_compiled_step", spy)
    before = warm_engine.compile_snapshot()
    rng = random.Random(8)
    buckets = set()
    for text in random_texts(60, seed=8, overflow=False):
        for spec in (False, True):
            r = warm_engine.generate(text, max_new_tokens=rng.randint(1, CAP),
                                     override=FlagOverride(native_step=False, speculative=spec))
            assert r.path == PATH_COMPILED and not r.native_step, r
            buckets.add(r.bucket)
    assert len(buckets) == len(BUCKETS), buckets
    delta = warm_engine.compile_snapshot().diff(before)
    assert rows_held == [0]  # compiled once, no row held while it did
    assert delta.recompiles == 0 and delta.recompile_limit_hits == 0, delta


def test_answers_crossing_attention_spans_compile_nothing(warm_engine, flags):
    """The attended cache span grows with the answer; every span runs the warm graphs."""
    spans = {warm_engine.target.bias_for(end).shape[-1]
             for end in range(1, warm_engine.target.slots + 1)}
    assert len(spans) > 1
    before = warm_engine.compile_snapshot()
    crossed = 0
    for text in random_texts(8, seed=21, overflow=False):
        for spec in (False, True):
            r = warm_engine.generate(text, max_new_tokens=CAP,
                                     override=FlagOverride(speculative=spec))
            ref = warm_engine.generate(text, max_new_tokens=CAP,
                                       override=FlagOverride(speculative=spec, compiled=False))
            assert r.path == PATH_COMPILED and ref.path == PATH_EAGER
            assert r.output_ids == ref.output_ids, text
            crossed += r.output_tokens > min(spans)
    assert crossed > 0  # some answers ran past the first span
    delta = warm_engine.compile_snapshot().diff(before)
    assert delta.recompiles == 0 and delta.graphs == 0, delta


def test_compiled_step_does_not_guard_on_the_model(warm_engine, flags):
    """Dynamo's guards on the model argument (weights, attributes) are not checked per call.

    A copy of the model with a different attribute would fail such a guard and recompile;
    each runner only ever passes its own model, so the compiled step skips those checks.
    """
    import copy

    runner = warm_engine.target
    edge = BUCKETS[0]
    fns = runner.compiled(edge)
    other = copy.copy(runner.m)
    other.eps = runner.m.eps * 2  # a guarded constant of the traced model
    before = warm_engine.compile_snapshot()
    with torch.no_grad():
        ids = torch.full((1, edge), other.eos_id, dtype=torch.long)
        mask = other.mask_bias(torch.ones((1, edge), dtype=torch.long))
        cross = fns.encode(runner.m, ids, mask, runner.encoder_bias(edge))
        fns.step(other, runner.start, runner.positions[0], runner.m.new_self_cache(runner.slots),
                 cross, mask, runner.bias_for(1), runner.steps)
    delta = warm_engine.compile_snapshot().diff(before)
    assert delta.recompiles == 0 and delta.graphs == 0, delta


def test_exact_shapes_recompile_with_reasons(warm_engine, flags):
    # Direct decoding: the speculative path's functions depend on the adaptive draft length.
    flags.update(bucketing=False, speculative_default=False)
    warm_engine.generate("x" * 9, max_new_tokens=2)  # first exact shape: first compile
    before = warm_engine.compile_snapshot()
    for n in (10, 11):
        warm_engine.generate("x" * n, max_new_tokens=2)
    delta = warm_engine.compile_snapshot().diff(before)
    # Each new length recompiles the exact-shape encoder (the step runs in C), with the
    # guard failure as the reason.
    assert delta.recompiles >= 2 and delta.graphs >= 2
    assert any("size" in reason or "mismatch" in reason for reason in delta.recompile_reasons)


def test_recompile_limit_hit_is_counted(tiny_dirs):

    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, use_draft=False, compile_backend="eager",
                                     recompile_limit=2))
    try:
        before = engine.compile_snapshot()
        outs = [engine.generate("y" * n, max_new_tokens=2,
                                override=FlagOverride(bucketing=False)) for n in range(3, 8)]
        delta = engine.compile_snapshot().diff(before)
        assert delta.recompile_limit_hits >= 1, delta
        # Past the limit dynamo runs eager silently: the output is still right.
        ref = [engine.generate("y" * n, max_new_tokens=2,
                               override=FlagOverride(bucketing=False, compiled=False))
               for n in range(3, 8)]
        assert [o.output_ids for o in outs] == [r.output_ids for r in ref]
    finally:
        engine.close()


def test_raised_recompile_limit_holds_on_other_threads(tiny_dirs):
    import threading

    from engine import load_engine

    # Dynamo's config is thread-local: the limit must hold on request threads too.
    engine = load_engine(tiny_config(tiny_dirs, use_draft=False, compile_backend="eager"))
    try:
        before = engine.compile_snapshot()
        outs: list = []
        worker = threading.Thread(target=lambda: outs.extend(
            engine.generate("z" * n, max_new_tokens=2, override=FlagOverride(bucketing=False))
            for n in range(3, 15)))
        worker.start()
        worker.join()
        delta = engine.compile_snapshot().diff(before)
        assert len(outs) == 12
        assert delta.recompile_limit_hits == 0, delta
        assert delta.recompiles >= 10, delta  # every new exact length really recompiled
    finally:
        engine.close()


def test_background_warmup_serves_eager_meanwhile(tiny_dirs):
    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, buckets=(8, 16), use_draft=False,
                                     compile_backend="eager"))
    try:
        first = engine.generate("abc", max_new_tokens=3)
        assert first.path == PATH_EAGER  # never warmed: no compile on the request path
        engine.warm_up(background=True)
        engine.warm_up(background=False)  # joins the running warm-up
        status = engine.warmup_status()
        assert status.done and status.warm_buckets == 2 and status.error is None
        assert status.seconds > 0
        second = engine.generate("abc", max_new_tokens=3)
        assert second.path == PATH_COMPILED and second.output_ids == first.output_ids
    finally:
        engine.close()


def test_compile_off_never_compiles(tiny_dirs):
    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"))
    try:
        before = engine.compile_snapshot()
        engine.warm_up(background=False)
        result = engine.generate("abc", max_new_tokens=3,
                                 override=FlagOverride(bucketing=False))
        assert result.path == PATH_EAGER
        assert engine.compile_snapshot().diff(before).graphs == 0
        assert engine.warmup_status().done
    finally:
        engine.close()
