"""The C compiler every test sees: the real one behind a cache of identical builds.

Loaded for the whole suite by tests/conftest.py (`pytest_plugins`). Each engine a test
starts has its own cache folder, and the engine builds its C step (engine.native) into
that folder: a second of the compiler a runtime, hundreds of times a run. `CC` is set to
tests/utils/cached_cc.sh for the session, which hands back an earlier build of the same
arguments, sources and compiler version and runs the real compiler otherwise; the engine's
own build path (version check, build into a temporary file, owner and mode checks, load)
runs as in production. Tests that set `CC` themselves wrap this one (native._compiler()).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

WRAPPER = Path(__file__).with_name("cached_cc.sh")


@pytest.fixture(scope="session", autouse=True)
def cached_c_compiler(tmp_path_factory: pytest.TempPathFactory,
                      request: pytest.FixtureRequest) -> Iterator[None]:
    """Point `CC` at the caching wrapper of the real compiler for the session."""
    real = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if real is None:  # no compiler: the engine's own fallback is what runs
        yield
        return
    base = tmp_path_factory.getbasetemp()
    # Under xdist the workers' folders share a parent: one build serves the whole run.
    cache = (base.parent if hasattr(request.config, "workerinput") else base) / "cc-cache"
    saved = {name: os.environ.get(name) for name in ("CC", "TW_REAL_CC", "TW_CC_CACHE")}
    os.environ.update(CC=str(WRAPPER), TW_REAL_CC=real, TW_CC_CACHE=str(cache))
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
