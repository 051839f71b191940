"""Exit with the parent: a worker started by `serve` must not outlive it.

Two portable signals, no prctl: `serve` holds the write end of the worker's stdin, so
the read returns end-of-file the moment `serve` exits for any reason (a SIGKILL too);
and the parent pid changes when the parent dies (the check that covers a pipe end
some other process inherited).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


class ParentWatch:
    """Call `on_gone` once when `stream` reaches end-of-file or the parent process changes.

    Example:
        watch = ParentWatch(sys.stdin.buffer, stop.set)
        watch.start()
    """

    def __init__(self, stream: BinaryIO, on_gone: Callable[[str], object], *,
                 getppid: Callable[[], int] = os.getppid) -> None:
        self._stream = stream
        self._on_gone = on_gone
        self._getppid = getppid
        self._parent = getppid()
        self._done = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Watch in two daemon threads."""
        threading.Thread(target=self._read, name="tailwatch-parent-pipe", daemon=True).start()
        threading.Thread(target=self._poll, name="tailwatch-parent-pid", daemon=True).start()

    def stop(self) -> None:
        """Stop watching (the pipe reader ends with the process)."""
        self._done.set()

    def _read(self) -> None:
        try:
            while self._stream.read(4096):
                pass  # nothing is sent: only the end of the stream matters
        except (OSError, ValueError):
            pass
        self._gone("the parent closed the worker's stdin")

    def _poll(self) -> None:
        while not self._done.wait(PARENT_CHECK_S):
            if self._getppid() != self._parent:
                self._gone(f"parent process {self._parent} is gone")
                return

    def _gone(self, why: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
        log.info("tailwatch worker: %s; stopping", why)
        self._on_gone(why)
