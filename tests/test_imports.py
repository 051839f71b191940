"""Importing the non-engine packages (and `engine` itself) must not import torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

PACKAGES = ["vocab", "storage", "alerts", "monitor", "probes", "engine", "engine.protocol",
            "engine.errors", "engine.config", "engine.validation"]


def test_packages_import_without_torch():
    present = [p for p in PACKAGES if importlib.util.find_spec(p.split(".")[0]) is not None]
    assert "engine" in present
    code = (
        "import sys\n"
        f"for name in {present!r}:\n"
        "    __import__(name)\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "", f"imported {out.stdout.strip()} via {present}"
