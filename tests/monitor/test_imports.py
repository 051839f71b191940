"""The service's HTTP layer never pulls in torch (it talks to engine.protocol only)."""

from __future__ import annotations

import subprocess
import sys


def test_service_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import monitor.app, monitor.api.flags, monitor.metrics, monitor.cli.operator\n"
        "import monitor.cli.serve, monitor.cli.config\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"torch pulled in: {out.stdout[:300]}"
