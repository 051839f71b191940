"""The alerts package never pulls torch in (click's tests/test_imports.py idea)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_alerts_does_not_import_torch():
    code = ("import json, sys\n"
            "import alerts, alerts.evaluator, alerts.outbox, alerts.flags, alerts.policy, "
            "alerts.baselines, alerts.config\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'probes', 'monitor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
