"""bench.preemption: its ABBA order, arrivals and report, its synthetic senders (one per
batch row), and runs of seconds on a tiny random T5 (compile off), unbatched and batched,
in which only the on arm preempts."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from bench.preemption import (
    Round,
    arm_order,
    arrivals,
    main,
    real_texts,
    report,
    run_round,
    summarize,
)
from engine.admission import AdmissionStats
from engine.protocol import Engine


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
    assert report({"on": on, "off": off}, max_batch=1) == lines  # unbatched: as before


def test_a_batched_report_says_its_max_batch_per_arm_and_on_the_last_line() -> None:
    rounds = [Round("on", [0.1], [0.0], preemptions=2), Round("off", [0.2], [0.1])]
    lines = report({arm: summarize(arm, rounds) for arm in ("on", "off")}, max_batch=4)
    header, on, off = (line.split() for line in lines[:3])
    assert header[:3] == ["arm", "max_batch", "real"] and header[-1] == "preemptions"
    assert on[:3] == ["on", "4", "1"] and off[:3] == ["off", "4", "1"]
    assert (on[-1], len(on), len(off)) == ("2", len(header), len(header))
    assert lines[-1] == "preemption: real p99 0.50x, max wait 0.00x (on / off) at max_batch 4"


class _Senders:
    """A stand-in engine that holds each synthetic sender's first request until `rows`
    of them are in flight at once (they could fill every row), and answers the rest."""

    def __init__(self, rows: int) -> None:
        self.lock = threading.Lock()
        self.first = threading.Barrier(rows, timeout=10)
        self.senders: set[str] = set()
        self.in_flight = self.most = self.real = 0
        self.prompts: list[str] = []

    def admission_stats(self) -> AdmissionStats:
        return AdmissionStats(preemptions=self.real)

    def generate(self, text: str, *, max_new_tokens: int, canary: bool = False) -> Any:
        if not canary:
            with self.lock:
                self.real += 1
            return SimpleNamespace(queue_wait_s=0.0, preempted_s=0.0)
        name = threading.current_thread().name
        with self.lock:
            first = name not in self.senders
            self.senders.add(name)
            self.prompts.append(text)
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            if first:
                self.first.wait()  # broken (an error) unless `rows` senders get here
            threading.Event().wait(0.002)
        finally:
            with self.lock:
                self.in_flight -= 1
        return SimpleNamespace(queue_wait_s=0.0, preempted_s=0.25)


def test_the_synthetic_load_has_one_sender_per_row_each_starting_elsewhere() -> None:
    fake = _Senders(rows=3)
    canaries = [f"canary {i}" for i in range(6)]
    out = run_round(cast(Engine, fake), "on", canaries, [0.05, 0.1], ["a", "b"],
                    new_tokens=4, senders=3)
    assert (fake.most, len(fake.senders)) == (3, 3)  # every row held by a synthetic one
    assert set(fake.prompts[:3]) == {"canary 0", "canary 2", "canary 4"}
    assert (len(out.latencies), out.real_failed, out.preemptions) == (2, 0, 2)
    assert out.synthetic_done == len(fake.prompts) >= 3 and out.synthetic_refused == 0
    assert out.preempted_s == pytest.approx(0.25 * out.synthetic_done)


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


@pytest.mark.slow
def test_a_batched_run_of_seconds_preempts_only_in_the_on_arm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.engine.conftest import build_tiny_t5

    target = build_tiny_t5(tmp_path / "target", seed=0)
    main(["--model-dir", str(target), "--compile-mode", "off", "--rounds", "2",
          "--seconds", "1", "--rate", "10", "--new-tokens", "8", "--max-batch", "2",
          "--cache-dir", str(tmp_path / "cache")])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert "max_batch 2," in lines[0] and "synthetic 2 senders back to back" in lines[0]
    assert [line.split()[2] for line in lines[1:3]] == ["on:", "off:"]  # both arms ran
    assert re.fullmatch(r"preemption: real p99 \d+\.\d\dx, max wait \d+\.\d\dx "
                        r"\(on / off\) at max_batch 2", lines[-1]), lines[-1]
    rows = {line.split()[0]: line.split() for line in lines[-3:-1]}
    assert set(rows) == {"on", "off"} and rows["on"][1] == rows["off"][1] == "2"
    # Two senders back to back hold both rows nearly all the time: of the real arrivals
    # (about 10), some find both held. Off, no extra row: never a preemption.
    assert int(rows["on"][-1]) > 0 and int(rows["off"][-1]) == 0  # preemptions
    assert int(rows["on"][2]) > 0 and int(rows["off"][2]) > 0  # real requests answered
    assert "in the timed round" not in captured.err  # compile off: no round compiled
