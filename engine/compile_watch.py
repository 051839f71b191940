"""Read torch.compile's own counters into a CompileSnapshot.

Sources (torch 2.13; private modules, checked by tests):
- graphs: `torch._dynamo.utils.counters["stats"]["unique_graphs"]`.
- graph breaks: `counters["graph_break"]` (reason -> count).
- recompiles: `torch._dynamo.callback.on_compile_start` gives each compile's id
  "frame/attempt"; attempt > 0 is a recompile of an already compiled frame. The same
  callback fires when cudagraph trees record a graph (trigger CUDAGRAPH_RECORDING, with
  the graph's compile id): those are counted as recordings, not compiles.
- recompile reasons: `torch._dynamo.utils.guard_failures` (code -> guard failure
  strings), recorded for every recompile even when TORCH_LOGS is off.
- compile seconds: on_compile_start -> on_compile_end.
- recompile-limit hits: dynamo only logs them ("torch._dynamo hit config.recompile_limit"),
  so a handler on the "torch._dynamo.convert_frame" logger counts them.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from engine.protocol import CompileSnapshot

_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
# torch prefixes each guard failure with its compile id ("0/1: ", "[0/1] ", "[0/1_1] "), and
# object-id guards carry addresses; both differ between otherwise identical recompiles.
_ID_PREFIX = re.compile(r"^\s*\[?\d+/\d+(?:_\d+)?\]?:?\s*")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}|\b\d{9,}\b")
REASON_MAX = 200
_LIMIT_LOGGER = "torch._dynamo.convert_frame"


def normalize_reason(text: str) -> str:
    """Return a guard-failure reason without its compile id and object addresses.

    "0/1: tensor 'ids' size mismatch at index 1. expected 16, actual 17" and
    "3/0: tensor 'ids' size mismatch ..." are the same recompile in two frames: both become
    "tensor 'ids' size mismatch at index 1. expected 16, actual 17". The guard text stays.
    """
    lines = str(text).strip().splitlines()
    line = lines[0] if lines else ""
    line = _ID_PREFIX.sub("", line)
    line = _ADDRESS.sub("<id>", line)
    return line.strip()[:REASON_MAX] or "?"


def top_recompile_reasons(counts: Iterable[Mapping[str, int]], limit: int = 5
                          ) -> list[tuple[str, int]]:
    """Merge reason -> count maps (normalizing older keys) and return the `limit` largest."""
    total: Counter[str] = Counter()
    for mapping in counts:
        for reason, n in mapping.items():
            total[normalize_reason(reason)] += int(n)
    return sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]


def _is_recording(args: object) -> bool:
    """Say whether a compile callback is cudagraph trees recording a graph."""
    trigger = getattr(args, "callback_trigger", None)
    return getattr(trigger, "name", None) == "CUDAGRAPH_RECORDING"


class _LimitHandler(logging.Handler):
    def __init__(self, watch: CompileWatch) -> None:
        super().__init__(level=logging.WARNING)
        self._watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config." in str(record.msg):
            self._watch._limit_hit()


class CompileWatch:
    """Process-wide compile counters (torch keeps them per process, so do we)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recompiles = 0
        self._seconds = 0.0
        self._limit_hits = 0
        self._failures = 0
        self._recordings = 0
        self._starts: dict[str, float] = {}
        self._attached = False

    def attach(self) -> None:
        """Install the torch hooks (idempotent); call before anything is compiled.

        Not at construction: importing torch._dynamo costs seconds of a start, and a warm
        CPU start serves saved packages and the C step without it (nothing to watch).
        Again where they are gone: torch._dynamo.reset() drops every compile callback (a
        benchmark that resets between modes would count no recompile after the first).
        """
        import torch._dynamo.callback as callback

        handler = getattr(callback, "callback_handler", None)
        with self._lock:  # held while registering: two callers never both register
            first = not self._attached
            self._attached = True
            if not first and (handler is None  # no list to look in: once, as before
                              or self._on_start in handler.start_callbacks):
                return
            callback.on_compile_start(self._on_start)
            callback.on_compile_end(self._on_end)
        if first:  # a logging handler, which reset() leaves alone
            logging.getLogger(_LIMIT_LOGGER).addHandler(_LimitHandler(self))

    def _on_start(self, args: object) -> None:
        compile_id = str(getattr(args, "compile_id", ""))
        if _is_recording(args):
            with self._lock:
                self._recordings += 1
            return
        with self._lock:
            self._starts[compile_id] = time.perf_counter()
            match = _COMPILE_ID.search(compile_id)
            if match and int(match.group(2)) > 0:
                self._recompiles += 1

    def _on_end(self, args: object) -> None:
        if _is_recording(args):
            return
        compile_id = str(getattr(args, "compile_id", ""))
        with self._lock:
            start = self._starts.pop(compile_id, None)
            if start is not None:
                self._seconds += time.perf_counter() - start

    def _limit_hit(self) -> None:
        with self._lock:
            self._limit_hits += 1

    def record_failure(self) -> None:
        """Count a compile that raised (the caller fell back to eager)."""
        with self._lock:
            self._failures += 1

    def snapshot(self) -> CompileSnapshot:
        """Return the cumulative counters now."""
        if "torch._dynamo" not in sys.modules:  # nothing was ever compiled in this process
            with self._lock:
                return CompileSnapshot(graphs=0, recompiles=0, recompile_reasons={},
                                       graph_breaks=0, graph_break_reasons={},
                                       compile_seconds=0.0, recompile_limit_hits=0,
                                       compile_failures=self._failures,
                                       cudagraph_recordings=self._recordings)
        from torch._dynamo.utils import counters, guard_failures

        reasons: dict[str, int] = {}
        for failures in list(guard_failures.values()):
            for reason in list(failures):
                key = normalize_reason(reason)
                reasons[key] = reasons.get(key, 0) + 1
        breaks = {str(k)[:200]: int(v) for k, v in list(counters["graph_break"].items())}
        with self._lock:
            return CompileSnapshot(
                graphs=int(counters["stats"]["unique_graphs"]),
                recompiles=self._recompiles,
                recompile_reasons=reasons,
                graph_breaks=sum(breaks.values()),
                graph_break_reasons=breaks,
                compile_seconds=self._seconds,
                recompile_limit_hits=self._limit_hits,
                compile_failures=self._failures,
                cudagraph_recordings=self._recordings,
            )


_shared: CompileWatch | None = None
_shared_lock = threading.Lock()


def shared_watch() -> CompileWatch:
    """Return the process's CompileWatch (its hooks are installed by `attach`)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompileWatch()
        return _shared


def specialize(fn: Callable, tag: str) -> Callable:
    """Copy `fn` with its own code object, so dynamo caches (and limits) it separately.

    Dynamo keys compiled graphs on the code object: per-bucket copies make every
    bucket a first compile rather than a recompile of one shared function, and a
    bucket's guards are checked against its own entries only.
    """
    name = f"{fn.__name__}__{re.sub(r'[^0-9A-Za-z_]', '_', tag)}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    out = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out
