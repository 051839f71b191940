"""Warm-up: compile (or load the saved functions of) every bucket before requests use it.

A bucket serves compiled only once it is warm; until then its requests run eager. The
busiest buckets (by earlier runs' traffic) warm first. A bucket whose warm-up fails stays
eager: it is counted as a compile failure, logged as an error and said in the status.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from engine import aot
from engine.compile_watch import CompileWatch
from engine.models import Models
from engine.protocol import WarmupStatus
from engine.runner import ModelRunner

log = logging.getLogger(__name__)


class Warmup:
    """Warm the buckets of one runtime's models, in the background or blocking; thread-safe.

    warm_bucket(edge, loaded): compile bucket `edge` by running its functions (`loaded`: its
    functions were loaded from the saved files, and each called once already) (the runtime runs
    them where requests run them: on the thread and caches requests use); return what it
    left ("recorded N CUDA graph(s)" or "no CUDA graphs: <why>"), or raise: the bucket then
    serves eager, which is logged as an error and said in the status ("eager: <why>").
    finished(): called once every bucket was tried.
    on_owner(fn): run fn on the thread that owns the compiled calls (the saved functions'
    first calls and warm_bucket run there).
    """

    def __init__(self, models: Models, *, buckets: Sequence[int], compile_on: bool,
                 saved_dir: Path | None, order: Callable[[], list[int]],
                 warm_bucket: Callable[[int, bool], str], watch: CompileWatch,
                 created: float, closed: Callable[[], bool],
                 finished: Callable[[], None] = lambda: None,
                 on_owner: Callable[[Callable[[], str]], str] = lambda fn: fn()) -> None:
        self._models = models
        self._buckets = tuple(buckets)
        self._compile_on = compile_on
        self.saved_dir = saved_dir  # compiled functions saved by precompile
        self._order = order
        self._warm_bucket = warm_bucket
        self._watch = watch
        self._created = created
        self._closed = closed
        self._finished = finished
        self._on_owner = on_owner
        self._graphs: dict[int, str] = {}
        self._lock = threading.Lock()
        self._warm: set[int] = set()
        self.bucket_compile_s: dict[int, float] = {}
        self.cache_hit: bool | None = None  # set once the warm-up knows (see WarmupStatus)
        self.saved_buckets = 0  # buckets this warm-up loaded from saved functions
        self.saved_failures = 0  # saved functions that failed to load (0 or 1: all compiled)
        self.thread: threading.Thread | None = None
        self._started: float | None = None
        self._seconds = 0.0
        self._done = False
        self._error: str | None = None
        self._ready_seconds: float | None = None

    def start(self, *, background: bool = True) -> None:
        """Warm every bucket (in a thread when background); a second call waits or returns."""
        with self._lock:
            running = self.thread
            if self._started is None:
                self._started = time.perf_counter()
                if not self._compile_on:
                    self._done = True
                    self._ready_seconds = time.perf_counter() - self._created
                    return
                if background:
                    self.thread = threading.Thread(target=self._warm_all,
                                                   name="engine-warmup", daemon=True)
                    self.thread.start()
                    return
                running = None
            elif running is None or background:
                return  # already warm, or warming in the background
        if running is not None:
            running.join()  # a blocking call waits for the warm-up already under way
        else:
            self._warm_all()

    def is_warm(self, edge: int) -> bool:
        """Return whether bucket `edge` has compiled graphs ready."""
        with self._lock:
            return edge in self._warm

    def status(self) -> WarmupStatus:
        """Return the warm-up's progress."""
        with self._lock:
            seconds = self._seconds
            if self._started is not None and not self._done:
                seconds = time.perf_counter() - self._started
            return WarmupStatus(total_buckets=len(self._buckets),
                                warm_buckets=len(self._warm), seconds=seconds,
                                done=self._done, error=self._error,
                                bucket_seconds={str(e): round(v, 3)
                                                for e, v in self.bucket_compile_s.items()},
                                cache_hit=self.cache_hit, ready_seconds=self._ready_seconds,
                                bucket_graphs={str(e): g for e, g in self._graphs.items()})

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a background warm-up (not from its own thread)."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    # --- saved functions (engine precompile) ---------------------------------------------

    def precompiled(self) -> bool:
        """Return whether every function the buckets need is saved for this runtime."""
        saved = self.saved_dir
        return saved is not None and all(
            runner.has_saved(saved, verify=verify)
            for runner, verify in self._models.compiled_runners())

    def save_compiled(self) -> int:
        """Compile the shared functions ahead of time and save them; return how many."""
        assert self.saved_dir is not None
        saved = 0
        for runner, verify in self._models.compiled_runners():
            try:
                saved += runner.save(self.saved_dir, verify=verify)
            except Exception as exc:  # noqa: BLE001 - starts then compile, as before
                log.warning("engine: %s: compiled functions not saved: %s: %s",
                            runner.name, type(exc).__name__, str(exc)[:300])
        return saved

    def _load_saved(self, edge: int) -> bool:
        """Serve bucket `edge` from saved functions; False when it must be compiled."""
        saved = self.saved_dir
        runners = self._models.warm_runners()
        if self.saved_failures:
            return False  # the buckets share the files: one failure stands for all
        if saved is None or not all(runner.has_saved(saved, verify=verify)
                                    for runner, verify in runners):
            return False  # never precompiled (or another shape): the usual compile
        try:
            for runner, verify in runners:
                runner.load_saved(edge, saved, verify=verify)
        except aot.AOTLoadError as exc:
            for runner, _verify in runners:
                runner.forget()
            with self._lock:
                self.saved_failures += 1
                first = self.saved_failures == 1
            # Once at warning: every bucket usually fails for the same reason.
            (log.warning if first else log.info)(
                "engine: bucket %d: saved compiled functions not used, compiling: %s",
                edge, exc)
            return False
        with self._lock:
            self.saved_buckets += 1
        return True

    def warm_deferred(self, runner: ModelRunner, edge: int, *, verify: bool) -> None:
        """Warm a runner warm-up left out (Models.deferred) on bucket `edge`'s shapes: from
        its saved functions where they load, else compiled (length-dynamic: every bucket)."""
        saved = self.saved_dir
        if saved is not None and not self.saved_failures and runner.has_saved(saved,
                                                                               verify=verify):
            try:
                runner.load_saved(edge, saved, verify=verify)
                return
            except aot.AOTLoadError as exc:
                runner.forget()
                log.warning("engine: %s: saved compiled functions not used, compiling: %s",
                            runner.name, exc)
        runner.warm(edge, verify=verify)

    def _warm_one(self, edge: int) -> str:
        return self._warm_bucket(edge, self._load_saved(edge))

    def _warm_all(self) -> None:
        aot.join_isa_probe()  # loading or compiling would otherwise run the probe again
        for edge in self._order():
            if self._closed():
                break
            started = time.perf_counter()
            try:
                graphs = self._on_owner(functools.partial(self._warm_one, edge))
            except Exception as exc:  # noqa: BLE001 - a bucket that fails to compile stays eager
                if self._closed():
                    break  # closed under it: not a failure of the bucket
                self._watch.record_failure()
                why = describe_failure(exc)[:480]
                log.error("engine: bucket %d serves eager: its warm-up failed: %s", edge, why,
                          exc_info=exc)
                with self._lock:
                    self._error = f"bucket {edge}: {why}"
                    self._graphs[edge] = f"eager: {why}"
                continue
            with self._lock:
                self._graphs[edge] = graphs
                self._warm.add(edge)
                self.bucket_compile_s[edge] = time.perf_counter() - started
                self._seconds = time.perf_counter() - (self._started or 0.0)
                warm = len(self._warm)
            log.info("engine: bucket %d warm in %.1f s (%d of %d)", edge,
                     self.bucket_compile_s[edge], warm, len(self._buckets))
        with self._lock:
            self._seconds = time.perf_counter() - (self._started or 0.0)
            self._done = True
            if len(self._warm) == len(self._buckets):
                self._ready_seconds = time.perf_counter() - self._created
            self.cache_hit = self.saved_buckets == len(self._buckets)
        self._finished()


def describe_failure(exc: BaseException) -> str:
    """Return `Type: message`, and where it was raised when the message is empty.

    A bare `assert` deep in torch says nothing on its own; the file and line of its raise
    are what an operator can search for.
    """
    text = f"{type(exc).__name__}: {exc}"
    if str(exc).strip():
        return text
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return text
    last = frames[-1]
    return f"{text.rstrip()} (raised at {Path(last.filename).name}:{last.lineno} in {last.name})"
