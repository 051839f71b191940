"""glibc malloc arenas: bound how many the process keeps, so RSS stays put after warm-up.

glibc gives threads malloc arenas of their own (up to 8 per core) and keeps what is freed
in an arena for that arena's later use. The engine is called from many threads (the HTTP
thread pool, a new thread per probe cycle, a burst's client threads), so each arena comes
to hold a request's working set of tensors, and RSS climbs with every new mix of threads
long after warm-up. Capping the arenas caps that; Python objects are unaffected (they
live in pymalloc's own arenas). `MALLOC_ARENA_MAX` in the environment, read by glibc
itself, always wins.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter number
DEFAULT_ARENAS = 2


@functools.cache  # looked up once: usage() runs at every metrics scrape
def _glibc(name: str) -> Any | None:
    """Return glibc's function `name` (None: not Linux, not glibc, or too old to have it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def limit_arenas(arenas: int = DEFAULT_ARENAS, *,
                 environ: Mapping[str, str] = os.environ) -> bool:
    """Cap glibc's malloc arenas at `arenas` unless MALLOC_ARENA_MAX is set; return whether
    the cap was set (False: not glibc, or the environment decides)."""
    if arenas < 1:
        raise ValueError(f"arenas: must be >= 1, got {arenas}")
    if "MALLOC_ARENA_MAX" in environ:
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:  # musl and others: no glibc arenas to bound
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(M_ARENA_MAX, arenas))
    if ok:
        log.debug("malloc: at most %d arenas", arenas)
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def usage() -> tuple[int, int] | None:
    """Return glibc malloc's bytes (in use, free but kept by its arenas); None: not glibc
    2.33+ (no mallinfo2)."""
    fn = _glibc("mallinfo2")
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    # hblkhd: blocks large enough to get an mmap of their own (in use until freed).
    return info.uordblks + info.hblkhd, info.fordblks


def trim() -> bool:
    """Return freed heap pages to the system (glibc's malloc_trim); return whether any
    were (False: not glibc, or nothing to return)."""
    fn = _glibc("malloc_trim")
    if fn is None:
        return False
    fn.argtypes = (ctypes.c_size_t,)
    return bool(fn(0))
