"""bench.batch_step: its --baseline times another build of the C step on the same rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import batch_step
from engine import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


def test_a_baseline_build_is_timed_on_the_same_rows_and_its_logits_compared(tmp_path, capsys):
    # The same source as a baseline: bitwise the same logits; a changed one that alters
    # the arithmetic (every ReLU output doubled): not the same.
    same = tmp_path / "same.c"
    same.write_bytes(native.SOURCE.read_bytes())
    batch_step.main(["--rows", "1,2", "--calls", "1", "--rounds", "1", "--baseline", str(same),
                     "--quantization", "int8"])
    out = capsys.readouterr().out
    assert "base us" in out and out.strip().splitlines()[-1].endswith("logits same: yes"), out
    changed = tmp_path / "changed.c"
    source = native.SOURCE.read_text()
    relu = "u[j] = u[j] > 0.0f ? u[j] : 0.0f;"
    assert source.count(relu) == 1
    changed.write_text(source.replace(relu, "u[j] = u[j] > 0.0f ? 2.0f * u[j] : 0.0f;"))
    batch_step.main(["--rows", "2", "--calls", "1", "--rounds", "1", "--baseline", str(changed)])
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith("logits same: NO")
    # float32: the products alone through the C step's kernel, beside torch.mm's rate
    assert "the same products through the C step's own (tw_gemm) at 2 positions: " in out, out


def test_a_missing_baseline_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.batch_step", "--baseline",
                           str(tmp_path / "none.c")], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"--baseline: no such file: {tmp_path / 'none.c'}")
