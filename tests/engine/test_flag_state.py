"""Issue 14: last known flags survive a restart; probation never overrides a manual off."""

from __future__ import annotations

import json
from pathlib import Path

from engine.flags import GuardedFlags
from engine.protocol import DECODING_DIRECT, PATH_EAGER, RuntimeFlags
from tests.engine.test_flags import TEXT, FlakyProvider


def test_guard_saves_the_last_good_flags_and_starts_from_them(tmp_path: Path):
    path = tmp_path / "var" / "last-flags.json"
    provider = FlakyProvider()
    provider.current = RuntimeFlags(compiled=False, speculative={"64": False},
                                    manual_off=frozenset({"64"}))
    guarded = GuardedFlags(provider, timeout_s=1.0, state_file=path)
    try:
        assert guarded.source == "defaults"
        assert guarded.read() == provider.current
        assert guarded.source == "live"
    finally:
        guarded.close()
    assert json.loads(path.read_text())["compiled"] is False
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".flags-")]  # no temp left
    provider.mode = "raise"  # the database is down at the restart
    restarted = GuardedFlags(provider, timeout_s=1.0, state_file=path)
    try:
        assert restarted.source == "file"
        assert restarted.read() == provider.current
        assert restarted.source == "file" and restarted.errors == 1
    finally:
        restarted.close()


def test_an_unreadable_state_file_falls_back_to_defaults(tmp_path: Path, caplog):
    path = tmp_path / "last-flags.json"
    path.write_text('{"compiled": "no"}')
    provider = FlakyProvider()
    provider.mode = "raise"
    guarded = GuardedFlags(provider, timeout_s=1.0, state_file=path)
    try:
        assert guarded.source == "defaults" and guarded.read() == RuntimeFlags()
    finally:
        guarded.close()
    assert any("ignoring unreadable" in r.getMessage() for r in caplog.records)


def test_engine_restarted_during_an_outage_keeps_the_fallbacks(tiny_dirs, tmp_path: Path):
    from engine import load_engine
    from tests.engine.conftest import tiny_config

    config = tiny_config(tiny_dirs, compile_mode="off", flags_file=str(tmp_path / "flags.json"))
    provider = FlakyProvider()
    provider.current = RuntimeFlags(speculative_default=False, compiled=False)
    engine = load_engine(config, flags=provider)
    try:
        engine.generate(TEXT, max_new_tokens=2)
        assert engine.flag_source() == "live"
    finally:
        engine.close()
    provider.mode = "raise"
    engine = load_engine(config, flags=provider)
    try:
        assert engine.flag_source() == "file"
        result = engine.generate(TEXT, max_new_tokens=2)
        assert result.decoding == DECODING_DIRECT and result.path == PATH_EAGER
    finally:
        engine.close()


def test_probation_never_applies_where_speculation_is_manually_off(warm_engine, flags):
    # Bucket 32 is automatically off (probation 50%); a person turned speculation off
    # everywhere: the kill switch must hold in bucket 16 and in 32 alike.
    flags.update(speculative_default=False, speculative={"32": False},
                 speculative_probation=0.5, manual_off=frozenset({"global"}))
    results = [warm_engine.generate(t, max_new_tokens=2) for t in [TEXT, "x" * 20] * 15]
    assert not any(r.probation for r in results)
    assert all(r.decoding == DECODING_DIRECT for r in results)
    # A manual off in one bucket keeps probation elsewhere.
    flags.update(manual_off=frozenset({"16"}), speculative={"16": False, "32": False})
    manual = [warm_engine.generate(TEXT, max_new_tokens=2) for _ in range(20)]
    auto = [warm_engine.generate("x" * 20, max_new_tokens=2) for _ in range(40)]
    assert warm_engine.bucket_for(warm_engine.count_tokens("x" * 20)) == "32"
    assert not any(r.probation for r in manual)
    assert any(r.probation for r in auto)
    flags.set(RuntimeFlags())
