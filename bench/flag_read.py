"""The flag read on the request path: `serve`'s flag snapshot read on the request's own
thread, against the same snapshot read through the guard's shared reader thread.

    taskset -c 1 python -m bench.flag_read [--reads 20000] [--callers 1,8] [--rounds 5]

Every request reads the runtime flags (engine.flags.GuardedFlags). `serve` gives the
engine the monitor's flag snapshot (alerts.flags.FlagSnapshot: flags held in memory,
refreshed from SQL by a thread of its own), here over a fresh SQLite database with one
flag set. Two guards over that one snapshot, in this process:
  held: as production reads it: the snapshot says it holds its flags in memory
      (`in_memory`), so the guard reads it on the caller's thread.
  shared reader: the same snapshot behind a wrapper that does not say so, so the guard
      reads it as any other provider: each read joins the read in flight on the guard's
      reader thread or starts one there, and waits for it (the path every request took
      before the snapshot said it was held in memory).
--callers threads read at once, --reads each, per round; rounds alternate the two guards.
Printed per caller count: the median over rounds of wall-clock microseconds per read, and
the ratio. Last line: `flag read at C callers: held X us, shared reader Y us (Nx)` for the
most callers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from alerts.flags import FlagSnapshot, FlagStore
from engine.flags import GuardedFlags
from engine.protocol import RuntimeFlags
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade


class SharedReader:
    """The snapshot without its `in_memory` mark: the guard reads it on its reader thread."""

    def __init__(self, snapshot: FlagSnapshot) -> None:
        self._snapshot = snapshot

    def flags(self) -> RuntimeFlags:
        return self._snapshot.flags()

    def invalidate(self) -> None:
        self._snapshot.invalidate()


def timed_reads(read: Callable[[], RuntimeFlags], callers: int, reads: int) -> float:
    """Return wall-clock seconds per read with `callers` threads reading `reads` each."""
    start = threading.Barrier(callers + 1)

    def run() -> None:
        start.wait()
        for _ in range(reads):
            read()

    threads = [threading.Thread(target=run) for _ in range(callers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) / (callers * reads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=20_000, help="reads per caller a round")
    parser.add_argument("--callers", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    callers = [int(c) for c in args.callers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'flags.db'}"
        upgrade(url)
        db = make_engine(url)
        sessions = make_sessionmaker(db)
        with sessions.begin() as s:
            FlagStore().set(s, "compiled", "global", False, reason="bench", actor="bench")
        snapshot = FlagSnapshot(sessions, ttl_s=1.0)
        snapshot.start()
        guards = {"held": GuardedFlags(snapshot, timeout_s=0.05),
                  "shared reader": GuardedFlags(SharedReader(snapshot), timeout_s=0.05)}
        try:
            for guard in guards.values():  # what both read is the stored flag
                assert guard.read().compiled is False
            print(f"reads per caller a round: {args.reads}, rounds: {args.rounds}")
            print(f"{'callers':>8} {'held_us':>9} {'shared_reader_us':>17} {'ratio':>7}")
            line = ""
            for c in callers:
                per: dict[str, list[float]] = {name: [] for name in guards}
                for _ in range(args.rounds):
                    for name, guard in guards.items():
                        per[name].append(timed_reads(guard.read, c, args.reads))
                held = statistics.median(per["held"]) * 1e6
                shared = statistics.median(per["shared reader"]) * 1e6
                print(f"{c:>8} {held:>9.2f} {shared:>17.2f} {shared / held:>6.1f}x")
                line = (f"flag read at {c} callers: held {held:.2f} us, shared reader "
                        f"{shared:.2f} us ({shared / held:.1f}x)")
            errors = sum(g.errors for g in guards.values())
            print(f"failed reads (both guards): {errors}")
            print(line)
        finally:
            for guard in guards.values():
                guard.close()
            snapshot.close()
            db.dispose()


if __name__ == "__main__":
    main()
