"""Bad input, limits, admission control, loading errors and what the engine reports."""

from __future__ import annotations

import threading

import pytest

from engine import load_engine
from engine.errors import (
    Cancelled,
    InputTooLong,
    InvalidRequest,
    ModelLoadError,
    Overloaded,
    RequestTimeout,
)
from engine.protocol import PATH_OVERFLOW, CancelSignal, Engine, FlagOverride
from monitor.loopback import wait_for
from tests.engine.conftest import CAP, MAX_INPUT, tiny_config


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"text": ""}, "text"),
    ({"text": "   "}, "text"),
    ({"text": "ok", "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "ok", "max_new_tokens": CAP + 1}, "max_new_tokens"),
    ({"text": "ok", "max_new_tokens": "5"}, "max_new_tokens"),
    ({"text": "ok", "timeout_s": 0}, "timeout_s"),
])
def test_bad_input_names_the_field(warm_engine, kwargs, field):
    text = kwargs.pop("text")
    with pytest.raises(InvalidRequest) as info:
        warm_engine.generate(text, **kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_too_long_input_and_overflow(warm_engine, flags):
    with pytest.raises(InputTooLong) as info:
        warm_engine.generate("x" * MAX_INPUT)  # MAX_INPUT + 1 tokens
    assert info.value.field == "text" and info.value.limit == MAX_INPUT
    result = warm_engine.generate("x" * (MAX_INPUT - 1), max_new_tokens=2)
    assert result.path == PATH_OVERFLOW and result.bucket == "overflow"
    assert result.padded_length == result.input_tokens == MAX_INPUT


def test_result_fields_and_reports(warm_engine, flags):
    assert isinstance(warm_engine, Engine)
    r = warm_engine.generate("hello", max_new_tokens=5, canary=True)
    assert r.canary and r.input_tokens == 6 == warm_engine.count_tokens("hello")
    assert r.bucket == warm_engine.bucket_for(6) == "8" and r.padded_length == 8
    assert 0 < r.encoder_s < r.ttft_s <= r.total_s and r.queue_wait_s >= 0
    assert abs(r.padding_waste - 2 / 8) < 1e-9
    info = warm_engine.info
    assert len(info.model_version) == 12 and info.buckets == (8, 16, 32)
    assert info.speculative_available and info.device == "cpu" and info.dtype == "float32"
    mem = warm_engine.memory_snapshot()
    assert mem.rss_bytes > 0 and mem.cuda_allocated_bytes is None
    # Bytes of tensors actually allocated, per position: 2 layers x K and V x 2 heads x 16
    # dims x 4 bytes. Static: both models' self caches (40 + 4 slots + 1 spare slot that
    # keeps every attended span a strict prefix), one set per decode stream
    # (engine.max_concurrency, unbatched) and one for admission's extra slot, where a real
    # request decodes while synthetic ones pause; per request: the cross K/V of the
    # 8-token bucket, for the draft too when the request speculated.
    per_position = 2 * 2 * 2 * 16 * 4
    assert warm_engine.config.max_batch == 1
    rows = warm_engine.config.max_concurrency + 1
    assert mem.kv_static_bytes == rows * 2 * per_position * (CAP + 4 + 1)
    assert r.kv_request_bytes == (2 if r.spec_k else 1) * per_position * 8
    assert mem.kv_request_bytes == 0 and mem.kv_cache_bytes == mem.kv_static_bytes
    assert mem.kv_request_peak_bytes >= r.kv_request_bytes
    assert mem.kv_peak_bytes >= mem.kv_static_bytes + r.kv_request_bytes
    status = warm_engine.warmup_status()
    assert status.done and status.warm_buckets == status.total_buckets == 3


def test_missing_files_raise_model_load_error(tmp_path, tiny_dirs):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_engine(tiny_config(tiny_dirs, model_dir=str(tmp_path / "nope")))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_dirs["target"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"broken: missing weights file"):
        load_engine(tiny_config(tiny_dirs, model_dir=str(broken)))


@pytest.mark.parametrize("leaves", ["past its deadline", "cancelled"])
@pytest.mark.parametrize("max_batch", [1, 2])
def test_overloaded_and_a_queued_caller_that_leaves(tiny_dirs, monkeypatch, max_batch, leaves):
    # Unbatched, one decode stream; batched, two rows: either way one more caller waits.
    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off", max_concurrency=1,
                                     max_queue=1, max_batch=max_batch))
    started, release = threading.Event(), threading.Event()
    original = engine._run_any

    def slow_run(*args, **kwargs):
        started.set()
        release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "_run_any", slow_run)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            engine.generate("abc", max_new_tokens=2)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    runners = [threading.Thread(target=call) for _ in range(max_batch)]
    for running in runners:
        started.clear()
        running.start()
        assert started.wait(10)
    waiting = threading.Thread(target=call)
    waiting.start()
    wait_for(lambda: engine.queue_depth() == 1, what="one queued caller")
    with pytest.raises(Overloaded) as info:
        engine.generate("abc", max_new_tokens=2)
    assert info.value.retry_after_s > 0
    release.set()
    for running in runners:
        running.join(10)
    waiting.join(10)
    assert errors == [] and engine.queue_depth() == 0
    # A queued caller whose deadline passes gets RequestTimeout, not a hang; one whose
    # caller cancels it once it waits gets Cancelled. Either way it leaves the queue.
    release.clear()
    runners = [threading.Thread(target=call) for _ in range(max_batch)]
    for running in runners:
        started.clear()
        running.start()
        assert started.wait(10)
    cancel = CancelSignal()
    left: list[BaseException] = []

    def queued_call() -> None:
        try:
            if leaves == "cancelled":
                engine.generate("abc", max_new_tokens=2, cancel=cancel)
            else:
                engine.generate("abc", max_new_tokens=2, timeout_s=0.05)
        except BaseException as exc:  # noqa: BLE001
            left.append(exc)

    waiting = threading.Thread(target=queued_call)
    waiting.start()
    if leaves == "cancelled":
        wait_for(lambda: engine.queue_depth() == 1, what="one queued caller")
        cancel.set()
    waiting.join(10)
    assert [type(exc) for exc in left] == [
        Cancelled if leaves == "cancelled" else RequestTimeout]
    assert engine.queue_depth() == 0
    release.set()
    for running in runners:
        running.join(10)
    assert errors == []
    stats = engine.admission_stats()
    assert stats.real_timeouts == (0 if leaves == "cancelled" else 1)
    # Every slot came back: a caller gets one at once.
    assert engine.generate("abc", max_new_tokens=2).output_tokens >= 1
    engine.close()


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("leaves", ["past its deadline", "cancelled"])
def test_an_unbatched_decode_stops_past_its_deadline_or_cancelled(tiny_dirs, monkeypatch,
                                                                   leaves, speculative):
    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"))
    cancel = CancelSignal()
    if leaves == "cancelled":
        run = engine.rows.run

        def cancelled_once_admitted(*args, **kwargs):
            cancel.set()  # after admission: the decode loop is what sees it
            return run(*args, **kwargs)

        monkeypatch.setattr(engine.rows, "run", cancelled_once_admitted)
    try:
        with pytest.raises(Cancelled if leaves == "cancelled" else RequestTimeout):
            engine.generate("x" * 20, max_new_tokens=CAP, cancel=cancel,
                            override=FlagOverride(speculative=speculative),
                            timeout_s=1e-4 if leaves == "past its deadline" else None)
        assert engine.admission_stats().real_waiting == 0
        assert engine.generate("x" * 20, max_new_tokens=2).output_tokens >= 1  # slot back
    finally:
        engine.close()
