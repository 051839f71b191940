"""Fixtures of the report tests: settings pointing at a temp output directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitor.settings import Settings, get_settings
from tests.monitor.report.synthetic import KV_BUDGET


@pytest.fixture
def report_settings(tmp_path: Path) -> Settings:
    """Return settings with a KV budget, a temp out_dir and no webhook summary."""
    return get_settings(report={"out_dir": str(tmp_path / "reports"),
                                "kv_cache_budget_bytes": KV_BUDGET, "notify": False})
