"""A CPU hog in a child process, pinned to a CPU set: a noisy neighbour on demand.

`Hog(cpus)` busy-loops `busy_ms` in every `period_ms` of wall time (100 of 100: a full
hog; 30 of 100: the milder neighbour) on `cpus` until stopped. The child pins itself
to `cpus` before it spins and the parent pins it again right after the start, so it
never spins anywhere else for long; it exits on its own when its parent goes away
(its parent pid changes), so a killed bench leaves no hog behind.

Example:
    with Hog(os.sched_getaffinity(service_pid)) as hog:
        ...                      # the service shares its core with the hog
    hog.returncode               # set once stopped

    python -m bench.hog --cpus 1 --busy-ms 30 --period-ms 100 --parent PID
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # an interpreter start on a busy core
READY = b"spinning"  # the child's first line: pinned, SIGTERM handled, about to spin


def spin(busy_s: float, period_s: float, parent: int) -> None:
    """Busy-loop `busy_s` in every `period_s` until the parent process changes."""
    while os.getppid() == parent:
        start = time.monotonic()
        end = start + busy_s
        while time.monotonic() < end:
            pass
        rest = start + period_s - time.monotonic()
        if rest > 0:
            time.sleep(rest)


class Hog:
    """Run a busy-looping child pinned to `cpus` from `start()` to `stop()`."""

    def __init__(self, cpus: Iterable[int], *, busy_ms: float = 100.0,
                 period_ms: float = 100.0) -> None:
        self.cpus = frozenset(cpus)
        if not self.cpus:
            raise ValueError("cpus: must name at least one CPU")
        if not 0 < busy_ms <= period_ms:
            raise ValueError(f"busy_ms: must be within (0, period_ms], got {busy_ms}")
        self.busy_ms, self.period_ms = busy_ms, period_ms
        self.returncode: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """Return the hog's pid."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> None:
        """Start the child, pin it to the CPU set and wait until it spins."""
        cpus = ",".join(map(str, sorted(self.cpus)))
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hog", "--cpus", cpus, "--busy-ms", str(self.busy_ms),
             "--period-ms", str(self.period_ms), "--parent", str(os.getpid())],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self._proc = proc
        # The child pins itself too; this closes the window before its interpreter starts.
        os.sched_setaffinity(proc.pid, self.cpus)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != READY:
            self.stop()
            raise RuntimeError(f"bench.hog did not start spinning (exit {self.returncode})")

    def stop(self) -> int | None:
        """Stop the child (SIGTERM, then SIGKILL); return its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return self.returncode
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            self.returncode = proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return self.returncode

    def __enter__(self) -> Hog:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def parse_cpus(text: str) -> set[int]:
    """Return the CPUs of a list like "0,2-3"."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Pin this process to --cpus and spin until the parent named by --parent is gone."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", required=True)
    ap.add_argument("--busy-ms", type=float, default=100.0)
    ap.add_argument("--period-ms", type=float, default=100.0)
    ap.add_argument("--parent", type=int, default=None)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, parse_cpus(args.cpus))
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(0))
    sys.stdout.buffer.write(READY + b"\n")
    sys.stdout.flush()
    spin(args.busy_ms / 1e3, args.period_ms / 1e3,
         args.parent if args.parent is not None else os.getppid())


if __name__ == "__main__":
    main(sys.argv[1:])
