"""bench.flag_read on a few reads: both guards read the stored flag, and it prints its line."""

from __future__ import annotations

import threading

from bench.flag_read import SharedReader, main, timed_reads
from engine.flags import GuardedFlags
from engine.protocol import InMemoryFlagProvider, RuntimeFlags


def test_the_baseline_guard_reads_on_its_reader_thread():
    readers: list[threading.Thread] = []
    held = InMemoryFlagProvider(RuntimeFlags(compiled=False))

    class Recording:
        def flags(self) -> RuntimeFlags:
            readers.append(threading.current_thread())
            return held.flags()

        def invalidate(self) -> None:
            pass

    guard = GuardedFlags(SharedReader(Recording()), timeout_s=1.0)  # type: ignore[arg-type]
    try:
        assert timed_reads(guard.read, callers=2, reads=5) > 0
        assert readers and threading.current_thread() not in readers
        assert all(t.name.startswith("flags") for t in readers)
    finally:
        guard.close()


def test_it_prints_a_row_per_caller_count_and_the_last_line(capsys):
    main(["--reads", "50", "--callers", "1,2", "--rounds", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == "failed reads (both guards): 0"
    assert out[-1].startswith("flag read at 2 callers: held ")
    assert sum(line.split()[0] in ("1", "2") for line in out) == 2
