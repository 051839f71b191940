"""What this torch offers, detected by feature (never by version number).

The engine is pinned to one torch, and also runs on an older one (the GPU image's
torch 2.11): where a feature is missing it takes the older path.

- `compile_recompile_limit`: torch.compile takes `recompile_limit` (a limit per compiled
  function). Without it the limit is dynamo's process-wide `config.recompile_limit`, raised
  (never lowered) to the engine's before anything compiles.
- `aot_precompile`: `torch.compile(...).aot_compile` is on by default and
  `torch.compiler.load_compiled_function` exists (engine.aot's `.aot` files). Without it,
  `engine precompile` saves no `.aot` function and a start compiles them instead.
- inductor options: only the ones this torch's inductor config knows are passed
  (`inductor_options`); an unknown one would fail every compile of the default mode.

Tests force a feature off with `forced_off(name)` to exercise the older path here.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

FEATURES = ("compile_recompile_limit", "aot_precompile")
_forced: set[str] = set()
_lock = threading.Lock()


def _compile_recompile_limit() -> bool:
    import inspect

    return "recompile_limit" in inspect.signature(torch.compile).parameters


def _aot_precompile() -> bool:
    # Importing dynamo costs seconds of a start: asked only where the engine compiles anyway.
    import torch._dynamo.config as dynamo_config

    return (getattr(dynamo_config, "enable_aot_compile", False) is True
            and hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch.compiler, "keep_portable_guards_unsafe"))


_DETECT = {"compile_recompile_limit": _compile_recompile_limit,
           "aot_precompile": _aot_precompile}


@functools.cache
def _detected(name: str) -> bool:
    return bool(_DETECT[name]())


def has(name: str) -> bool:
    """Return whether this torch offers feature `name` (one of FEATURES)."""
    if name not in _DETECT:
        raise ValueError(f"feature: must be one of {FEATURES}, got {name!r}")
    with _lock:
        if name in _forced:
            return False
    return _detected(name)


@contextmanager
def forced_off(*names: str) -> Iterator[None]:
    """Answer `has(name)` False for each of `names` inside the block (tests: the older path)."""
    for name in names:
        if name not in _DETECT:
            raise ValueError(f"feature: must be one of {FEATURES}, got {name!r}")
    with _lock:
        added = set(names) - _forced
        _forced.update(added)
    try:
        yield
    finally:
        with _lock:
            _forced.difference_update(added)


def raise_recompile_limit(limit: int) -> None:
    """Raise dynamo's process-wide recompile limit to `limit` (the older path for a torch
    whose torch.compile takes no `recompile_limit`)."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < limit:
        dynamo_config.recompile_limit = limit


_dropped_said: set[str] = set()


def inductor_options(options: Mapping[str, object]) -> dict[str, object]:
    """Return the `options` this torch's inductor knows (each dropped one said once)."""
    from torch._inductor import config as inductor_config

    kept: dict[str, object] = {}
    for key, value in options.items():
        # guard_filter_fn is read by torch.compile itself, not by inductor's config.
        if key == "guard_filter_fn" or hasattr(inductor_config, key):
            kept[key] = value
            continue
        with _lock:
            first = key not in _dropped_said
            _dropped_said.add(key)
        if first:
            log.info("torch %s: inductor has no option %r; compiled without it",
                     torch.__version__, key)
    return kept
