"""Probes and the scheduler import without torch (probes -> engine.protocol only)."""

from __future__ import annotations

import subprocess
import sys


def test_probes_scheduler_and_cli_do_not_import_torch() -> None:
    code = ("import sys; import probes.cycle, probes.burst, probes.traffic, probes.sink, "
            "probes.prober, storage.queries.speedups, probes.fake, monitor.scheduler, "
            "monitor.leader, monitor.cli.probe; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
