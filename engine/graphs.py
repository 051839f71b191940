"""The seam between compiled calls: which graphs were recorded, replayed, and on what thread.

Under CUDA graphs (compile_mode reduce-overhead or max-autotune on CUDA) torch records one
graph per distinct call: the shapes of its inputs and the addresses of its static inputs
(the row caches). A call that matches a recorded one replays it; any other records anew,
which after warm-up costs a recording on a request's path. Each compiled function is
wrapped here so every call is counted by that signature (on CPU too, where nothing is
recorded: the same counts prove the warm-up covered what requests call), and so the rules
CUDA graphs need are checked where they can be seen:

- a compiled call's outputs live in graph memory that the next replay overwrites: an
  output must be copied before it feeds another compiled call (`aliases` counts inputs
  that share storage with an output still held; `check_aliases` holds outputs so their
  storage cannot be reused by another tensor, which a test needs and CUDA graphs forbid),
  and must not be read once the next compiled call has run (`check_aliases` overwrites
  the held outputs then, as a replay would, so a late read gives wrong tokens on CPU too);
- every compiled call starts a new generation of the trees (`cudagraph_mark_step_begin`):
  otherwise a call made while the previous call's outputs are still referenced records
  as that call's child, so a function records once per path of calls that led to it
  (paths a request can reach and the warm-up did not) instead of once per signature;
- cudagraph trees are per thread: every compiled call runs on the owner thread
  (`off_owner` counts those that did not, once an owner is set), and that thread holds
  the trees' per-thread state (`prepare_owner_thread`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from engine.protocol import GraphSnapshot


def prepare_owner_thread() -> None:
    """Give the calling thread cudagraph trees' per-thread state, if it has none.

    Inductor sets that state up on the thread that imports it (and autograd copies it to
    its own threads); a plain Python thread has none, and its first CUDA-graph recording
    fails on a bare assert in torch, so every bucket would serve eager. The owner thread
    gets its own, which is what per-thread trees mean: its graphs are its own.
    """
    import collections
    import warnings

    with warnings.catch_warnings():
        # Inductor's first import can warn about torch's own deprecated modules.
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls(
            "tree_manager_containers"):
        return
    initialize = getattr(trees, "_initialize_tls", None)
    if initialize is not None:
        initialize(trees.local)
        return
    # Older torch: the same steps as its module-level setup.
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)


@dataclass
class _Counts:
    recorded: int = 0
    recorded_after_warmup: int = 0
    replayed: int = 0
    off_owner: int = 0
    aliases: int = 0


def _signature(tag: str, args: tuple[Any, ...]) -> tuple[Hashable, ...]:
    """Return what decides whether a call replays a recorded graph: the function, each
    tensor's shape and dtype, a static input's address, and the other plain arguments."""
    sig: list[Hashable] = [tag]
    for a in args:
        if isinstance(a, torch.Tensor):
            static = getattr(a, "_dynamo_static_input_type", None) is not None
            sig.append((tuple(a.shape), a.dtype, a.data_ptr() if static else None))
        elif isinstance(a, (int, float, str, bool)) or a is None:
            sig.append(a)
        else:
            sig.append(type(a).__name__)  # the model: one per wrapped function
    return tuple(sig)


def _function(sig: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
    """Return the compiled graph a signature calls: it without static inputs' addresses
    (one graph serves every row's cache; each address is a recording of its own)."""
    return tuple(s[:2] if isinstance(s, tuple) and len(s) == 3 else s for s in sig)


def _overwrite(value: Any, keep: set[int]) -> None:
    """Fill a call's outputs with values no model produces (NaN, -1), as the next replay
    may, except those whose storage is an input of this call (counted as aliases instead)."""
    if isinstance(value, (tuple, list)):
        for v in value:
            _overwrite(v, keep)
    elif isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in keep:
        with torch.no_grad():
            if value.is_floating_point():
                value.fill_(float("nan"))
            elif value.dtype != torch.bool:
                value.fill_(-1)


def _storages(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, (tuple, list)):
        return [p for v in value for p in _storages(v)]
    return []


class GraphLedger:
    """Count the compiled calls of one runtime by signature; check the hand-offs."""

    def __init__(self, *, cudagraphs: bool, tree_warmup: bool = False,
                 check_aliases: bool = False) -> None:
        self.cudagraphs = cudagraphs  # whether torch records CUDA graphs for these calls
        # Whether to count as cudagraph trees do (a CUDA-graph mode, on CPU too): a compiled
        # function's first call is their warm-up run, and only later calls record.
        self.tree_warmup = tree_warmup
        self.check_aliases = check_aliases
        self._lock = threading.Lock()
        self._seen: set[tuple[Hashable, ...]] = set()
        self._warmed: set[tuple[Hashable, ...]] = set()  # functions past their warm-up run
        self._counts = _Counts()
        self._warm_done = False
        self._owner: threading.Thread | None = None
        self._held: dict[str, Any] = {}  # tag -> its last outputs (check_aliases only)
        self._previous: Any = None  # the last call's outputs (check_aliases only)
        self._held_ptrs: dict[str, list[int]] = {}

    def set_owner(self, thread: threading.Thread) -> None:
        """Make `thread` the only one compiled calls may run on."""
        self._owner = thread

    def warm_done(self) -> None:
        """Mark the end of warm-up: a new signature from now on is a recording on a request."""
        with self._lock:
            self._warm_done = True

    def wrap(self, fn: Callable, tag: str) -> Callable:
        """Return `fn` counted and checked at every call."""

        mark = torch.compiler.cudagraph_mark_step_begin if self.cudagraphs else None

        def counted(*args: Any) -> Any:
            self._before(tag, args)
            if mark is not None:
                mark()
            out = fn(*args)
            self._after(tag, out)
            return out

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    def _before(self, tag: str, args: tuple[Any, ...]) -> None:
        sig = _signature(tag, args)
        owner = self._owner
        off = owner is not None and threading.current_thread() is not owner
        aliased = 0
        if self.check_aliases:
            held = {p for ptrs in self._held_ptrs.values() for p in ptrs}
            inputs = {p for a in args for p in _storages(a)}
            aliased = sum(1 for a in args for p in _storages(a) if p in held)
            _overwrite(self._previous, keep=inputs)
        with self._lock:
            function = _function(sig)
            if self.tree_warmup and function not in self._warmed:
                # Run eagerly by the trees, recorded by nothing: the next call records.
                self._warmed.add(function)
            elif sig not in self._seen:
                self._seen.add(sig)
                self._counts.recorded += 1
                if self._warm_done:
                    self._counts.recorded_after_warmup += 1
            else:
                self._counts.replayed += 1
            self._counts.off_owner += off
            self._counts.aliases += aliased

    def _after(self, tag: str, out: Any) -> None:
        if self.check_aliases:
            with self._lock:
                self._held[tag] = out
                self._held_ptrs[tag] = _storages(out)
                self._previous = out

    def recorded(self) -> int:
        """Return the calls so far that recorded a graph (a signature not seen before)."""
        with self._lock:
            return self._counts.recorded

    def snapshot(self) -> GraphSnapshot:
        """Return the counts since start."""
        with self._lock:
            c = self._counts
            return GraphSnapshot(cudagraphs=self.cudagraphs, signatures=len(self._seen),
                                 recorded=c.recorded,
                                 recorded_after_warmup=c.recorded_after_warmup,
                                 replayed=c.replayed, off_owner_calls=c.off_owner,
                                 aliased_inputs=c.aliases)
