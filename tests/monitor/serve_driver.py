"""Run `tailwatch <args>` with the fake engine standing in for the runtime (no torch).

Tests start it as a real process: `python -m tests.monitor.serve_driver serve ...`.
Everything else is production: the CLI, uvicorn, the lifespan, the worker child.
"""

from __future__ import annotations

import sys
from typing import Any

import monitor.app
from monitor.cli import main
from tests.monitor.fakes import FakeFactory

_create_app = monitor.app.create_app


def _with_fake_engine(settings: Any, **kwargs: Any) -> Any:
    return _create_app(settings, engine_factory=FakeFactory(), **kwargs)


if __name__ == "__main__":
    monitor.app.create_app = _with_fake_engine  # type: ignore[assignment]
    sys.exit(main(sys.argv[1:]))
