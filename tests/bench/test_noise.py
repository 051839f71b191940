"""The benches' recorded canary noise: a replay never uses fewer canaries than it says."""

from __future__ import annotations

import json
import random
import sys

import pytest

from bench.detection import NOISE_FILE, QUIET_NOISE_FILE, RECORD_PER_BUCKET, LatencyNoise, PooledP99
from bench.incidents import BlockNoise


@pytest.mark.parametrize("path", [NOISE_FILE, QUIET_NOISE_FILE])
def test_shipped_recordings_hold_real_cycles_of_ten(path) -> None:
    sample = json.loads(path.read_text())
    assert sample["per_bucket"] == RECORD_PER_BUCKET
    assert all(len(c) == RECORD_PER_BUCKET for cycles in sample["latency_s"].values()
               for c in cycles)
    noise = BlockNoise(sample, cv=None, per_cycle=RECORD_PER_BUCKET)
    assert len(next(noise.stream(random.Random(0)))) == RECORD_PER_BUCKET


def test_incidents_refuse_more_canaries_than_recorded() -> None:
    sample = json.loads(NOISE_FILE.read_text())
    with pytest.raises(ValueError, match="fewer than 11 canaries"):
        BlockNoise(sample, cv=None, per_cycle=RECORD_PER_BUCKET + 1)


def test_detection_says_when_a_cycle_is_joined_from_smaller_recorded_ones() -> None:
    sample = json.loads(NOISE_FILE.read_text())
    small = dict(sample, latency_s={b: [c[:4] for c in cycles]
                                    for b, cycles in sample["latency_s"].items()})
    joined = PooledP99(LatencyNoise(small), per_cycle=10)
    assert "joined from recorded cycles of 4" in joined.what
    assert len(joined.cycle(random.Random(0), 0.0)) == 10
    real = PooledP99(LatencyNoise(sample), per_cycle=10)
    assert "joined" not in real.what


@pytest.mark.parametrize("module", ["bench.detection", "bench.incidents"])
def test_a_missing_noise_file_is_one_line_and_exit_2(module, monkeypatch, capsys, tmp_path):
    import importlib

    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, "--noise", str(tmp_path / "typo.json")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--noise: no such file" in err[-1]
