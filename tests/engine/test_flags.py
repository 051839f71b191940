"""Runtime flags: read every request, fail-safe, per-call overrides, probation."""

from __future__ import annotations

import threading
import time

from engine.flags import GuardedFlags
from engine.protocol import (
    DECODING_DIRECT,
    DECODING_SPECULATIVE,
    PATH_COMPILED,
    PATH_EAGER,
    PATH_EXACT,
    RuntimeFlags,
)

TEXT = "x" * 12  # 13 tokens: bucket 16
WAIT_S = 30.0  # a deadline for a read in flight, never a sleep


def test_flag_changes_take_effect_on_next_request(warm_engine, flags):
    first = warm_engine.generate(TEXT, max_new_tokens=4)
    assert (first.path, first.decoding) == (PATH_COMPILED, DECODING_SPECULATIVE)
    flags.update(speculative={"16": False})
    second = warm_engine.generate(TEXT, max_new_tokens=4)
    assert second.decoding == DECODING_DIRECT and not second.probation
    other_bucket = warm_engine.generate("x" * 20, max_new_tokens=4)
    assert other_bucket.decoding == DECODING_SPECULATIVE
    flags.update(compiled=False)
    assert warm_engine.generate(TEXT, max_new_tokens=4).path == PATH_EAGER
    flags.update(compiled=True, bucketing=False)
    exact = warm_engine.generate(TEXT, max_new_tokens=4)
    assert exact.path == PATH_EXACT and exact.padded_length == exact.input_tokens == 13
    flags.set(RuntimeFlags())
    assert warm_engine.generate(TEXT, max_new_tokens=4).path == PATH_COMPILED
    assert first.output_ids == second.output_ids == exact.output_ids


def test_probation_share_speculates_a_sample(warm_engine, flags):
    flags.update(speculative={"16": False}, speculative_probation=0.5)
    results = [warm_engine.generate(TEXT, max_new_tokens=2) for _ in range(60)]
    probation = [r for r in results if r.probation]
    assert 10 < len(probation) < 50
    assert all(r.decoding == DECODING_SPECULATIVE for r in probation)
    assert all(r.decoding == DECODING_DIRECT for r in results if not r.probation)


class FlakyProvider:
    """Return `flags` until told to raise or hang."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.current = RuntimeFlags()
        self.release = threading.Event()

    def flags(self) -> RuntimeFlags:
        if self.mode == "raise":
            raise ConnectionError("flag server down")
        if self.mode == "hang":
            self.release.wait(5)
        return self.current


class ManualClock:
    """A monotonic clock the test moves: a hang is declared without waiting it out."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_guarded_flags_keep_last_known_on_error_and_hang():
    provider = FlakyProvider()
    clock = ManualClock()
    guarded = GuardedFlags(provider, timeout_s=0.05, hang_s=0.2, monotonic=clock)
    try:
        assert guarded.settle(0)  # nothing read yet: nothing in flight
        assert guarded.read() == RuntimeFlags()
        provider.current = RuntimeFlags(compiled=False)
        assert guarded.read().compiled is False
        provider.mode = "raise"
        provider.current = RuntimeFlags(bucketing=False)
        assert guarded.read() == RuntimeFlags(compiled=False)
        assert guarded.errors == 1
        provider.mode = "hang"
        assert guarded.read() == RuntimeFlags(compiled=False)
        assert guarded.errors == 1  # slow so far, not failed
        clock.now += 0.25  # past hang_s: the read in flight now counts, once
        assert guarded.read() == RuntimeFlags(compiled=False)
        assert guarded.read() == RuntimeFlags(compiled=False)  # still hung: not re-called
        assert guarded.errors == 2
        assert not guarded.settle(0.01)  # still in flight: settle says so, not a stale True
        provider.mode = "ok"
        provider.release.set()
        assert guarded.settle(WAIT_S)  # the hung read lands
        assert guarded.last == RuntimeFlags(bucketing=False)
        assert guarded.read() == RuntimeFlags(bucketing=False)
        assert guarded.errors == 2
    finally:
        provider.release.set()
        guarded.close()


class SlowProvider:
    """A healthy provider slower than the read timeout; counts its calls."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0
        self.lock = threading.Lock()

    def flags(self) -> RuntimeFlags:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return RuntimeFlags(compiled=False)


def test_32_concurrent_reads_of_a_slow_healthy_provider_count_no_error(caplog):
    provider = SlowProvider(0.2)  # 4x the 50 ms timeout: each waiting reader gives up
    guarded = GuardedFlags(provider, timeout_s=0.05)
    start = threading.Barrier(32)
    results: list[RuntimeFlags] = []

    def request() -> None:
        start.wait()
        for _ in range(3):
            results.append(guarded.read())
            time.sleep(0.05)

    try:
        threads = [threading.Thread(target=request) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 96
        assert guarded.errors == 0
        assert not [r for r in caplog.records if r.name == "engine.flags"]
        # Readers shared reads: far fewer provider calls than requests.
        assert provider.calls < 20
        # The slow reads complete: later requests see their flags.
        assert guarded.settle(WAIT_S)
        assert guarded.last == RuntimeFlags(compiled=False)
        assert guarded.read() == RuntimeFlags(compiled=False)
    finally:
        guarded.close()


def test_raising_provider_is_counted_once_per_read_and_logged_rate_limited(caplog):
    provider = FlakyProvider()
    provider.current = RuntimeFlags(speculative_default=False)
    guarded = GuardedFlags(provider, timeout_s=1.0)
    try:
        assert guarded.read() == provider.current
        provider.mode = "raise"
        for _ in range(5):
            assert guarded.read() == RuntimeFlags(speculative_default=False)  # last known
        assert guarded.errors == 5
        lines = [r for r in caplog.records if r.name == "engine.flags"]
        assert len(lines) == 1 and "ConnectionError: flag server down" in lines[0].getMessage()
    finally:
        guarded.close()


def test_engine_survives_raising_provider(tiny_dirs):
    from engine import load_engine
    from tests.engine.conftest import tiny_config

    provider = FlakyProvider()
    provider.current = RuntimeFlags(speculative_default=False)
    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"), flags=provider)
    try:
        assert engine.generate(TEXT, max_new_tokens=3).decoding == DECODING_DIRECT
        provider.mode = "raise"
        result = engine.generate(TEXT, max_new_tokens=3)
        assert result.decoding == DECODING_DIRECT  # last known flags, not defaults
        assert engine.flag_errors() == 1
    finally:
        engine.close()


def test_flag_timeout_setting_reaches_the_engine():
    from monitor.settings import Settings

    settings = Settings(database_url="sqlite://", engine={"flag_timeout_s": 0.5})
    assert settings.engine.flag_timeout_s == 0.5


class HeldProvider:
    """Flags held in memory (FlagProvider.in_memory); records the threads that read them."""

    in_memory = True

    def __init__(self, flags: RuntimeFlags) -> None:
        self.current = flags
        self.threads: list[threading.Thread] = []

    def flags(self) -> RuntimeFlags:
        self.threads.append(threading.current_thread())
        return self.current


def test_flags_held_in_memory_are_read_on_the_callers_thread(tmp_path, monkeypatch):
    import engine.flags as engine_flags

    saved_on: list[threading.Thread] = []
    save = engine_flags.save_flags

    def recording_save(path, flags):
        saved_on.append(threading.current_thread())
        save(path, flags)

    monkeypatch.setattr(engine_flags, "save_flags", recording_save)
    provider = HeldProvider(RuntimeFlags(compiled=False))
    state = tmp_path / "last-flags.json"
    guarded = GuardedFlags(provider, timeout_s=0.05, state_file=state)
    try:
        assert all(guarded.read().compiled is False for _ in range(100))
        assert provider.threads == [threading.current_thread()] * 100  # no reader thread
        assert guarded.source == "live" and guarded.errors == 0
        # The state file is still written, once per new snapshot, off the request's thread.
        deadline = time.monotonic() + WAIT_S
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        provider.current = RuntimeFlags(compiled=False, bucketing=False)
        assert guarded.read().bucketing is False
    finally:
        guarded.close()
    assert state.exists()
    assert saved_on and threading.current_thread() not in saved_on


def test_a_held_provider_that_fails_keeps_the_last_known_flags():
    provider = HeldProvider(RuntimeFlags(compiled=False))
    guarded = GuardedFlags(provider, timeout_s=0.05)
    try:
        assert guarded.read().compiled is False

        def broken() -> RuntimeFlags:
            raise ConnectionError("not read yet")

        provider.flags = broken  # type: ignore[method-assign]
        assert guarded.read().compiled is False and guarded.errors == 1
    finally:
        guarded.close()
