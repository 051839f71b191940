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
import ctypes, importlib, re, sys, tempfile, threading
if sys.argv[1] != "none":
    importlib.import_module(sys.argv[1])  # the service's path: `engine` caps when imported
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
    print(len(re.findall(r"<heap nr=", open(f.name).read())))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc arenas only")


def arenas(module: str) -> int:
    """Return the arenas twelve threads use after importing `module` ("none": nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    return int(subprocess.run([sys.executable, "-c", SCRIPT, module], capture_output=True,
                              text=True, check=True, env=env).stdout)


@glibc
def test_importing_the_engine_package_caps_the_arenas_of_many_threads() -> None:
    assert arenas("engine") <= 2 < arenas("none")


def test_the_environment_decides_when_it_sets_malloc_arena_max() -> None:
    assert limit_arenas(2, environ={"MALLOC_ARENA_MAX": "4"}) is False


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="arenas"):
        limit_arenas(0)
