"""engine.malloc: the arena cap bounds the arenas many threads create (glibc only)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from engine.malloc import limit_arenas

# Twelve threads alive at once, each allocating from its own arena unless capped; prints
# the number of arenas (malloc_info's <heap> entries).
SCRIPT = r"""
import ctypes, re, sys, tempfile, threading
from engine.malloc import limit_arenas
capped = limit_arenas(2) if sys.argv[1] == "cap" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
barrier = threading.Barrier(12)
def work():
    libc.malloc(1000)  # from this thread's arena; kept so the arena stays in use
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(12)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(capped, len(re.findall(r"<heap nr=", open(f.name).read())))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc arenas only")


def _arenas(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    return out[0], int(out[1])


@glibc
def test_the_cap_bounds_the_arenas_of_many_threads() -> None:
    (set_cap, capped), (_, uncapped) = _arenas("cap"), _arenas("none")
    assert set_cap == "True"
    assert capped <= 2 < uncapped


def test_the_environment_decides_when_it_sets_malloc_arena_max() -> None:
    assert limit_arenas(2, environ={"MALLOC_ARENA_MAX": "4"}) is False


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="arenas"):
        limit_arenas(0)
