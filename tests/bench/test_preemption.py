"""bench.preemption: its ABBA order, arrivals and report, and a run of seconds on a tiny
random T5 (compile off) in which only the on arm preempts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.preemption import Round, arm_order, arrivals, main, real_texts, report, summarize


def test_the_rounds_alternate_the_arms_abba() -> None:
    assert arm_order(2) == ["on", "off"]
    assert arm_order(8) == ["on", "off", "off", "on", "on", "off", "off", "on"]


def test_arrivals_are_poisson_within_the_round_and_the_same_for_a_seed() -> None:
    schedule = arrivals(100.0, 10.0, seed=3)
    assert schedule == sorted(schedule) and schedule[0] > 0 and schedule[-1] < 10.0
    assert 900 < len(schedule) < 1100 and schedule == arrivals(100.0, 10.0, seed=3)
    texts = real_texts((16, 32), 40, seed=1)
    assert {len(t) < 16 for t in texts} == {True, False}  # both buckets
    assert all(8 <= len(t) <= 31 for t in texts) and texts == real_texts((16, 32), 40, 1)


def test_the_report_pools_each_arms_rounds_and_ends_with_on_over_off() -> None:
    rounds = [Round("on", [0.1, 0.2], [0.0, 0.01], synthetic_done=5, preempted_s=0.3,
                    preemptions=2),
              Round("off", [0.2, 0.6], [0.1, 0.5], real_failed=1, synthetic_done=6),
              Round("off", [0.4], [0.2], synthetic_refused=3),
              Round("on", [0.3], [0.02], synthetic_done=4, preempted_s=0.1, preemptions=1)]
    on, off = summarize("on", rounds), summarize("off", rounds)
    assert (on.real, on.p99_s, on.wait_max_s, on.preemptions) == (3, 0.3, 0.02, 3)
    assert on.preempted_s == pytest.approx(0.4) and on.synthetic_done == 9
    assert (off.real, off.real_failed, off.max_s, off.synthetic_refused) == (3, 1, 0.6, 3)
    lines = report({"on": on, "off": off})
    assert lines[-1] == "preemption: real p99 0.50x, max wait 0.04x (on / off)"
    assert summarize("on", []).real == 0  # no request answered: nan, not a crash
    assert report({"on": summarize("on", []), "off": off})[-1] == (
        "preemption: real p99 nanx, max wait nanx (on / off)")


@pytest.mark.slow
def test_a_run_of_seconds_preempts_only_in_the_on_arm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp_path / "target", seed=0)
    main(["--model-dir", str(target), "--compile-mode", "off", "--rounds", "2",
          "--seconds", "1", "--rate", "10", "--new-tokens", "8",
          "--cache-dir", str(tmp_path / "cache")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"preemption: real p99 \d+\.\d\dx, max wait \d+\.\d\dx \(on / off\)",
                        lines[-1]), lines[-1]
    rows = {line.split()[0]: line.split() for line in lines[-3:-1]}
    assert set(rows) == {"on", "off"}
    assert int(rows["on"][-1]) > 0 and int(rows["off"][-1]) == 0  # preemptions
    assert int(rows["on"][1]) > 0 and int(rows["off"][1]) > 0  # real requests answered
