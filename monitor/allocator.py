"""The C heap of a long-running process: glibc malloc's arenas, mmap threshold and trims.

glibc gives threads malloc arenas of their own (up to 8 per core) and keeps what a
thread freed in its arena for reuse rather than returning it to the kernel. The serving
process's bursts run many short-lived client threads whose tensors land in those arenas;
the worker's hourly evaluation reads a whole history into buffers it frees minutes later.
Both leave the resident size at the highest peak so far, scattered over arenas: freed
memory that looks like a leak. `memory.arena_max` caps the arenas (set before the
process starts its threads), `memory.mmap_threshold_bytes` fixes the size above which a
block gets a mapping of its own (glibc otherwise raises that threshold whenever such a
block is freed, so later large buffers land in the heap and fragment it), and the
`memory_trim` job hands the free pages of every arena back to the kernel.

Only glibc has these calls: elsewhere (macOS, musl) every method does nothing.

Example:
    allocator = Allocator.load()
    allocator.configure(settings.memory)   # before any thread starts
    allocator.trim()                       # True when glibc released memory
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# glibc refuses a fixed mmap threshold above HEAP_MAX_SIZE / 2 (64-bit: 32 MiB).
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


class MemorySettings(BaseModel):
    """The `memory` section: glibc malloc of `serve` and `worker` (no effect elsewhere)."""

    # Arenas glibc may create; 0 leaves its own limit (8 per core). Few arenas keep freed
    # memory where the next allocation finds it, at some lock contention between threads.
    arena_max: int = Field(2, ge=0, le=64)
    # Blocks of at least this many bytes get a mapping of their own, returned when freed;
    # None keeps glibc's dynamic threshold (128 KiB rising to 32 MiB as large blocks free).
    mmap_threshold_bytes: int | None = Field(None, ge=4096, le=MMAP_THRESHOLD_MAX)
    # How often the `memory_trim` job returns free heap pages to the kernel; 0: never.
    trim_interval_s: float = Field(60.0, ge=0)


@dataclass(frozen=True)
class HeapUsage:
    """glibc's own account of its heap (mallinfo2), in bytes."""

    in_use: int  # allocated and not freed (uordblks + hblkhd)
    free: int  # free in the arenas, resident or not (fordblks)
    mapped: int  # in blocks with a mapping of their own (hblkhd)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def glibc() -> Any | None:
    """Return the process's C library when it is glibc with mallopt and malloc_trim, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # gnu_get_libc_version is glibc's alone: musl has mallopt as a stub that does nothing.
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt",
                                                  "malloc_trim")):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim.restype = ctypes.c_int
    if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
        libc.mallinfo2.restype = _MallInfo2
    return libc


class Allocator:
    """glibc malloc's knobs; with `libc` None (not glibc) every method does nothing."""

    def __init__(self, libc: Any | None) -> None:
        self.libc = libc

    @classmethod
    def load(cls) -> Allocator:
        """Return the allocator of this process's C library."""
        return cls(glibc())

    @property
    def available(self) -> bool:
        """Return whether the calls reach glibc."""
        return self.libc is not None

    def configure(self, settings: MemorySettings) -> dict[str, int]:
        """Apply `settings`' arena cap and mmap threshold; return what glibc accepted.

        Call it before the process starts threads: an arena exists until the process ends,
        so a cap set later only stops new ones.
        """
        if self.libc is None:
            return {}
        wanted = {}
        if settings.arena_max:
            wanted["arena_max"] = (M_ARENA_MAX, settings.arena_max)
        if settings.mmap_threshold_bytes is not None:
            wanted["mmap_threshold_bytes"] = (M_MMAP_THRESHOLD, settings.mmap_threshold_bytes)
        applied = {}
        for name, (param, value) in wanted.items():
            if self.libc.mallopt(param, value) == 1:
                applied[name] = value
            else:  # glibc keeps its default: the process runs, with more memory
                log.warning("memory.%s: glibc refused %d; its default stays", name, value)
        return applied

    def trim(self) -> bool:
        """Return the free pages of every arena to the kernel; True when any were released."""
        if self.libc is None:
            return False
        return bool(self.libc.malloc_trim(0))

    def usage(self) -> HeapUsage | None:
        """Return glibc's heap account (None without glibc 2.33's mallinfo2)."""
        if self.libc is None or not hasattr(self.libc, "mallinfo2"):
            return None
        info = self.libc.mallinfo2()
        return HeapUsage(in_use=info.uordblks + info.hblkhd, free=info.fordblks,
                         mapped=info.hblkhd)
