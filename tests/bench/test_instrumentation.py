"""bench.instrumentation end to end on a tiny random T5 for seconds: the batch-N closed
loop with the loop's and the app's recording on and off, the figure on the last line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.instrumentation import Overhead, main, report

pytestmark = pytest.mark.slow


def test_the_bench_times_recording_on_against_off_and_prints_the_share_last(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp_path / "target", seed=0)
    main(["--model-dir", str(target), "--compile-mode", "off", "--callers", "8",
          "--requests", "16", "--rounds", "1", "--new-tokens", "4",
          "--cache-dir", str(tmp_path / "cache")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"instrumentation: \d+\.\d{3}% of a request at batch 8", lines[-1])
    recorded = next(line for line in lines if line.startswith("recording CPU per request"))
    steps = int(re.search(r"\((\d+) steps recorded\)", recorded).group(1))
    assert steps > 0  # the on rounds ran the production recorder


def test_the_figures_are_recording_over_the_process_cpu_and_the_median_rounds() -> None:
    o = Overhead(callers=32, requests=100, on_s=(2.0, 2.2, 2.1), off_s=(2.0, 1.9, 2.1),
                 loop_s=0.004, app_s=0.0023, steps=300, on_wall_s=12.0, off_wall_s=10.0)
    assert o.timed == pytest.approx(0.0063 / 6.3)
    assert o.on_off == pytest.approx(2.1 / 2.0 - 1)
    assert o.spread == pytest.approx(0.2 / 2.0)
    lines = report(o)
    assert lines[-1] == "instrumentation: 0.100% of a request at batch 32"
    assert "off 30.0 req/s, on 25.0 req/s" in lines[0]
