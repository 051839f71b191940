"""CPU priority of the monitor's own analysis work, so it yields the CPU to serving.

The analysis jobs (evaluation, delivery, retention, report, sensitivity) run on threads
of their own whose nice value is `worker.nice`: when they compete for a core with the
engine, the API or the canaries, the scheduler favours those. On Linux a nice value
belongs to one thread (NPTL), so the process's other threads keep theirs, and a thread
inherits the value of the thread that starts it.

A nice value weighs a thread only against the threads of its task group (sched(7)). On
a kernel with autogroups each session is one, and `serve` starts its worker in a session
of its own: there the worker's thread values do not count against `serve`'s threads, so
the worker also lowers its session's autogroup to `worker.nice` (`lower_session_priority`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from functools import partial
from pathlib import Path

from apscheduler.executors.pool import ThreadPoolExecutor

log = logging.getLogger(__name__)

NICE_MIN, NICE_MAX = 0, 19
THREAD_PREFIX = "tailwatch-analysis"
AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-N nice V"; absent without autogroups


def _who() -> int:
    # Linux: the calling thread's id names that thread alone; elsewhere 0 is the process.
    return threading.get_native_id() if sys.platform.startswith("linux") else 0


def _check(nice: int) -> None:
    if not NICE_MIN <= nice <= NICE_MAX:
        raise ValueError(f"worker.nice: must be between {NICE_MIN} and {NICE_MAX}, got {nice}")


def thread_nice() -> int:
    """Return the calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, _who())


def lower_priority(nice: int) -> int:
    """Raise the calling thread's nice value to `nice` (never lower it); return the value.

    Lowering a nice value needs privileges: a thread started nicer than `nice` stays so.
    A refusal is logged, not raised (the work runs either way).
    """
    _check(nice)
    current = thread_nice()
    if nice <= current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, _who(), nice)
    except OSError as exc:
        log.warning("worker.nice: cannot set nice %d on the analysis thread: %s", nice, exc)
        return current
    return nice


def _start_thread(nice: int) -> None:
    # A pool initializer that raised would break the pool: lower_priority only logs.
    lower_priority(nice)


def analysis_executor(nice: int, threads: int) -> ThreadPoolExecutor:
    """Return an APScheduler executor whose threads run at nice value `nice`."""
    _check(nice)
    return ThreadPoolExecutor(threads, pool_kwargs={
        "initializer": partial(_start_thread, nice), "thread_name_prefix": THREAD_PREFIX})


def lower_session_priority(nice: int, autogroup: Path = AUTOGROUP) -> bool:
    """Raise this process's autogroup nice value to `nice` when it leads its session.

    Returns whether the autogroup's value is now `nice` or higher. Only a session leader's
    autogroup is its own: a worker started from a shell shares the shell's session, which
    is left alone (its threads still run at `worker.nice` within it).
    """
    _check(nice)
    if os.getsid(0) != os.getpid():
        return False
    try:
        current = int(autogroup.read_text().split()[-1])
        if nice > current:
            autogroup.write_text(str(nice))
    except (OSError, ValueError, IndexError) as exc:
        log.debug("worker.nice: no autogroup to lower (%s)", exc)
        return False
    return True
