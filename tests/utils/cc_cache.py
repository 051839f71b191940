"""The C compiler every test sees: the real one behind a cache of identical builds.

Loaded for the whole suite by tests/conftest.py (`pytest_plugins`). Each engine a test
starts has its own cache folder, and the engine builds its C step (engine.native) into
that folder, so the compiler would run again for every runtime. `CC` is set to
tests/utils/cached_cc.sh for the session, which hands back an earlier build of the same
arguments, sources and compiler version and runs the real compiler otherwise; the engine's
own build path (version check, build into a temporary file, owner and mode checks, load)
runs as in production. Tests that set `CC` themselves wrap this one (native._compiler()).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

WRAPPER = Path(__file__).with_name("cached_cc.sh")


@pytest.fixture(scope="session", autouse=True)
def cached_c_compiler(tmp_path_factory: pytest.TempPathFactory,
                      request: pytest.FixtureRequest) -> Iterator[None]:
    """Point `CC` at the caching wrapper of the real compiler for the session."""
    from engine import native

    real = native._compiler()
    if real is None:  # no compiler: the engine's own fallback is what runs
        yield
        return
    base = tmp_path_factory.getbasetemp()
    # Under xdist the workers' folders share a parent: one build serves the whole run.
    cache = (base.parent if hasattr(request.config, "workerinput") else base) / "cc-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", str(WRAPPER))
        mp.setenv("TW_REAL_CC", real)
        mp.setenv("TW_CC_CACHE", str(cache))
        yield
