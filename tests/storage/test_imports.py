"""Importing storage pulls in neither torch nor the packages above it."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "transformers", "engine", "probes", "alerts", "monitor")


def test_storage_imports_stay_below_the_engine_and_monitor() -> None:
    code = (
        "import json, sys\n"
        "import storage, storage.db, storage.models, storage.migrate, storage.queries, "
        "storage.retention, storage.rollups, storage.writer, storage.synthetic, "
        "storage.histograms, storage.sketches, storage.queries.latency\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
