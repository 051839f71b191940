"""bench.self_interference's computations on rows the production code writes, and a tiny run.

The history comes from `storage.synthetic.simulate` (as in `bench.evaluation`), the
canary cycles are stored with `probes.sink.add_cycle` (the prober's path), and the
ratios are read back through `storage.queries.speedups` (the report's pairs). One slow test runs `main` itself for a
round of two blocks of seconds on the real service (eager, so it starts in seconds).
"""

from __future__ import annotations

import math
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from bench.self_interference import (
    EMPTY,
    HISTORY,
    Block,
    block_order,
    block_spread,
    effect_intervals,
    effect_line,
    fill_history,
    headline,
    intervals,
    main,
    measure,
    medians,
    parse_sets,
    read_decoding,
    read_samples,
    spread_line,
)
from bench.service import Answer
from bench.service_incidents import _group
from probes.cycle import CycleResult, PromptPair
from probes.sink import add_cycle
from storage.db import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeRun

END = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _cycle(s: object, minute: int, instance: str,
           pairs: dict[str, list[dict[str, float]]]) -> None:
    """Store an A/B cycle whose canary prompts ran the given latencies, arm by arm."""
    at = END + timedelta(minutes=minute)
    prompt_pairs = tuple(PromptPair(bucket, f"p{i}", tuple(lat), lat)
                         for bucket, prompts in pairs.items()
                         for i, lat in enumerate(prompts))
    groups = tuple(_group(bucket, arm, [lat[arm] for lat in prompts if arm in lat])
                   for bucket, prompts in pairs.items()
                   for arm in dict.fromkeys(a for lat in prompts for a in lat))
    add_cycle(s, CycleResult(  # type: ignore[arg-type]
        suite="in_domain", instance_id=instance, started_at=at,
        finished_at=at + timedelta(seconds=5), status="ok",
        ab=any(len(lat) > 1 for prompts in pairs.values() for lat in prompts),
        groups=groups, pairs=prompt_pairs, model_version="m", config_hash="c"))


def test_history_is_written_per_replica_up_to_the_start(tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'h.db'}")
    upgrade(db)
    rows = fill_history(db, END, days=0.02, replicas=2)
    with make_sessionmaker(db)() as s:
        per_instance = dict(s.execute(select(ProbeRun.instance_id, func.count())
                                      .group_by(ProbeRun.instance_id)).all())
        first, last = s.execute(select(func.min(ProbeRun.started_at),
                                       func.max(ProbeRun.started_at))).one()
    db.dispose()
    assert set(per_instance) == {"sim-1", "sim-2"}
    assert per_instance["sim-1"] == per_instance["sim-2"] == 28  # a cycle a minute
    assert rows > sum(per_instance.values())  # results, rollups and samples too
    assert END - timedelta(days=0.02) <= first.replace(tzinfo=UTC) < last.replace(tzinfo=UTC) < END


def test_ratios_pair_each_prompts_optimized_request_with_its_direct_arm(
        tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade(db)
    with make_sessionmaker(db).begin() as s:
        _cycle(s, 0, "bench", {"16": [{"optimized": 0.030, "direct": 0.015},
                                      {"optimized": 0.040, "direct": 0.010}],
                               "32": [{"optimized": 0.040, "direct": 0.040}]})
        _cycle(s, 1, "bench", {"16": [{"optimized": 0.060, "direct": 0.020, "eager": 0.1},
                                      {"optimized": 0.050, "eager": 0.1}]})  # no direct
        _cycle(s, 2, "bench", {"16": [{"optimized": 0.500}]})  # no arms: not paired
        _cycle(s, 3, "sim-1", {"16": [{"optimized": 0.900, "direct": 0.001}]})  # history
    samples, cycles = read_samples(db)
    decoding = read_decoding(db)
    db.dispose()
    assert cycles == 2
    # What the engine chose for the optimized canaries: all speculative, 4 tokens a draft.
    assert decoding == {"16": (1.0, 4.0), "32": (1.0, 4.0)}
    assert samples == {"16": pytest.approx([2.0, 4.0, 3.0]), "32": pytest.approx([1.0])}
    # The median as the speedups take it: the middle one, or the geometric mean of two.
    assert medians(samples) == {"16": pytest.approx(3.0), "32": pytest.approx(1.0)}
    assert medians({"16": [2.0, 8.0]}) == {"16": pytest.approx(4.0)}
    assert intervals({"16": [1.0] * 5, "32": [float(k) for k in range(1, 21)]}) == {
        "16": (None, None), "32": (6.0, 15.0)}


def test_blocks_alternate_so_each_arm_runs_early_and_late() -> None:
    assert block_order(1) == [EMPTY, HISTORY]
    assert block_order(2) == [EMPTY, HISTORY, HISTORY, EMPTY]
    assert block_order(3) == [EMPTY, HISTORY, HISTORY, EMPTY, EMPTY, HISTORY]
    with pytest.raises(ValueError, match="rounds"):
        block_order(0)


def _answers(stall_s: float, p99_s: float, n429: int, t0: float = 0.0) -> tuple[Answer, ...]:
    out = [Answer(t0 + i, 200, 0.02, "16") for i in range(100)]
    out += [Answer(t0 + i, 200, p99_s, "256") for i in range(100)]
    out.append(Answer(t0 + 50, 200, 0.02 + stall_s, "16"))  # the one stalled request
    out += [Answer(t0 + 40 + i / 10, 429, 0.001) for i in range(n429)]  # during the burst
    return (*out, Answer(t0 + 10, 429, 0.001), Answer(t0 + 20, 0, 120.0))


def _block(arm: str, answers: tuple[Answer, ...], samples: dict[str, list[float]],
           t0: float = 0.0) -> Block:
    return Block(arm=arm, answers=answers, samples=samples, cycles=5,
                 windows=((t0 + 39, t0 + 43),), burst="ok in 2.0 s")


def test_the_headline_compares_the_arms_over_their_blocks() -> None:
    empty = measure(EMPTY, [
        _block(EMPTY, _answers(0.2, 0.05, 0), {"16": [2.0, 2.0], "32": [1.0]}),
        _block(EMPTY, _answers(0.1, 0.05, 0, t0=1000), {"16": [2.0]}, t0=1000)])
    history = measure(HISTORY, [
        _block(HISTORY, _answers(0.3, 0.055, 2), {"16": [2.02, 2.02], "64": [1.0]}),
        _block(HISTORY, _answers(0.1, 0.055, 0, t0=1000), {"16": [1.0], "32": [0.95]},
               t0=1000)])
    assert (history.blocks, history.cycles) == (2, 10)
    assert (history.ok, history.rejected_429, history.errors) == (402, 4, 2)
    assert history.rejected_in_burst == 2
    # Per block: one 429 in the 95 s outside its 4 s window, 4/95 expected inside it.
    assert history.expected_in_burst == pytest.approx(2 * 4 / 95)
    assert history.stall_s == pytest.approx(0.3)  # the worst block's, against its medians
    assert history.ratios == {"16": pytest.approx(2.02), "32": pytest.approx(0.95),
                              "64": pytest.approx(1.0)}
    assert history.burst == "ok in 2.0 s; ok in 2.0 s"
    assert headline(empty, history) == ("history effect: ratio 5.0%, traffic p99 +10.0%, "
                                        "stall 1.50x; real requests shed by probes: 2")


def test_the_spread_between_blocks_of_one_arm_states_the_ratios_resolution() -> None:
    blocks = {
        EMPTY: [_block(EMPTY, (), {"16": [1.0, 1.0, 1.2], "256": [0.77]}),
                _block(EMPTY, (), {"16": [1.02], "256": [1.10]})],
        # One block of bucket 64 only: nothing to compare it with.
        HISTORY: [_block(HISTORY, (), {"16": [1.0], "64": [0.5]}),
                  _block(HISTORY, (), {"16": [1.05]})],
    }
    spread = block_spread(blocks)
    assert spread is not None
    value, bucket, arm = spread
    assert (bucket, arm) == ("256", EMPTY)
    assert value == pytest.approx(1.10 / 0.77 - 1)
    assert spread_line(spread) == ("between blocks of one arm: up to 42.9% (bucket 256, "
                                   "empty); a history effect on the ratio below this is not "
                                   "resolved")
    one_each = {EMPTY: blocks[EMPTY][:1], HISTORY: blocks[HISTORY][:1]}
    assert block_spread(one_each) is None
    assert spread_line(None).startswith("between blocks of one arm: one block per arm")


def test_the_history_effect_has_an_interval_over_blocks() -> None:
    # Bucket 16: blocks at 1.00 / 1.02 (empty) and 1.03 / 1.05 (history); bucket 64 in
    # one block per arm has no spread to take an interval from.
    blocks = {
        EMPTY: [_block(EMPTY, (), {"16": [1.0], "64": [0.5]}), _block(EMPTY, (), {"16": [1.02]})],
        HISTORY: [_block(HISTORY, (), {"16": [1.03], "64": [0.6]}),
                  _block(HISTORY, (), {"16": [1.05]})],
    }
    effects = effect_intervals(blocks)
    assert set(effects) == {"16"}
    e = [math.log(1.0), math.log(1.02)]
    h = [math.log(1.03), math.log(1.05)]
    d = statistics.fmean(h) - statistics.fmean(e)
    se = math.sqrt((statistics.variance(e) + statistics.variance(h)) / 2 * (1 / 2 + 1 / 2))
    v, lo, hi = effects["16"]
    assert v == pytest.approx(math.exp(d) - 1)
    assert (lo, hi) == (pytest.approx(math.exp(d - 4.303 * se) - 1),
                        pytest.approx(math.exp(d + 4.303 * se) - 1))
    assert lo < 0.03 < hi  # two blocks an arm: +3.0% is not resolved
    assert effect_line(effects) == (
        f"history effect on the ratio, 95% over blocks: largest {v * 100:+.1f}% "
        f"[{lo * 100:+.1f}%, {hi * 100:+.1f}%] (bucket 16); not resolved at 3% "
        f"(intervals reach {max(-lo, hi) * 100:.1f}%)")
    close = [_block(arm, (), {"16": [v]}) for arm, v in
             ((EMPTY, 1.0), (EMPTY, 1.001), (HISTORY, 1.0), (HISTORY, 1.001))]
    same = {EMPTY: close[:2], HISTORY: close[2:]}
    assert effect_line(effect_intervals(same)).endswith("within 3% in every bucket")
    assert effect_line({}).endswith("needs two blocks in an arm")


def test_set_overrides_become_nested_settings_and_bad_ones_one_line() -> None:
    assert parse_sets(["worker.nice=0", "engine.buckets=[16, 32]", "engine.compile_mode=off",
                       "engine.native_step=false"]) \
        == {"worker": {"nice": 0},
            "engine": {"buckets": [16, 32], "compile_mode": "off", "native_step": False}}
    with pytest.raises(SystemExit, match=r"--set: unknown setting worker\.nise; did you mean "
                                         r"worker\.nice\?"):
        parse_sets(["worker.nise=0"])
    with pytest.raises(SystemExit, match="--set: expected KEY=VALUE, got 'worker.nice'"):
        parse_sets(["worker.nice"])


HEADLINE = re.compile(r"history effect: ratio (\S+)%, traffic p99 (\S+)%, stall (\S+)x; "
                      r"real requests shed by probes: (\d+)")


@pytest.mark.slow
def test_a_tiny_run_goes_through_every_block(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    main(["--rounds", "1", "--minutes", "0.1", "--rate", "2", "--days", "0.01",
          "--replicas", "1", "--folder", str(tmp_path),
          # Eager and without the C step: ready in seconds, as the compiled engine is not.
          "--set", "engine.compile_mode=off", "--set", "engine.native_step=false"])
    lines = capsys.readouterr().out.splitlines()
    labels = [line.split(":")[0] for line in lines if line.startswith("block ")]
    assert list(dict.fromkeys(labels)) == ["block 1/2 empty", "block 2/2 history"], lines
    assert "rows of history (0.01 days x 1 replicas)" in "\n".join(lines)
    assert [line.split(":")[0] for line in lines if "optimized canaries' decoding" in line] \
        == ["block 1/2 empty", "block 2/2 history"]
    assert any(line.startswith("empty (1 blocks): ") for line in lines)
    assert any(line.startswith("history (1 blocks): ") for line in lines)
    assert lines[-3].startswith("between blocks of one arm: "), lines[-3]
    assert lines[-2].endswith("needs two blocks in an arm"), lines[-2]
    m = HEADLINE.fullmatch(lines[-1])
    assert m is not None, lines[-1]
    assert m.group(4) == "0"  # a burst sheds its own requests, never real ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1-empty", "2-history"]


@pytest.mark.slow
def test_a_stopped_run_stops_the_service_of_its_block(tmp_path: Path) -> None:
    """SIGTERM to the bench unwinds it: the service it started stops with it (it outlived
    the bench before, serving and probing beside whatever ran next)."""
    with subprocess.Popen(
            [sys.executable, "-m", "bench.self_interference", "--rounds", "1", "--minutes",
             "5", "--rate", "1", "--days", "0.01", "--replicas", "1", "--folder",
             str(tmp_path), "--set", "engine.compile_mode=off", "--set",
             "engine.native_step=false"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        serving: list[psutil.Process] = []
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + 300
            while "ready;" not in (line := proc.stdout.readline()):
                assert line and time.monotonic() < deadline, "the first block never got ready"
            serving = [p for p in psutil.process_iter(["cmdline"])
                       if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
            assert serving  # serve and its worker
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 128 + signal.SIGTERM
            _, alive = psutil.wait_procs(serving, timeout=30)
            assert not alive, alive
        finally:
            if proc.poll() is None:
                proc.kill()
            for p in serving:
                if p.is_running():
                    p.kill()  # left by a failure: no orphan beyond the test either
