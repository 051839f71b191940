"""bench.gpu's own logic against a fake runner: the table, the exit codes, and a bucket that
silently ran eager (or recompiled, or skipped CUDA graphs, or disagreed) failing the check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest

from bench import gpu

GROUPS = {"16": ["a b", "c d"], "32": ["a long one", "another long one"]}
REFERENCE = {t: (5, 6, 1) for texts in GROUPS.values() for t in texts}


def _result(mode: str, dtype: str, **changes: object) -> gpu.ModeResult:
    compiled = mode != gpu.EAGER
    cuda_graphs = mode in gpu.CUDAGRAPH_MODES
    ms = 10.0 if compiled else 40.0
    buckets = tuple(gpu.BucketTiming(bucket=label, requests=4, ms_per_request=ms,
                                      ms_per_token=ms / 3, spec_ms_per_request=ms * 0.8,
                                      paths=("compiled",) if compiled else ("eager",),
                                      cudagraph=("replayed",) if cuda_graphs else ("none",))
                    for label in GROUPS)
    warmed = {label: ("recorded 6 CUDA graph(s)" if cuda_graphs
                      else f"no CUDA graphs: compile_mode {mode}") for label in GROUPS}
    base = dict(mode=mode, dtype=dtype, buckets=buckets, outputs=dict(REFERENCE),
                graphs=4 if compiled else 0, cudagraph_skips=0,
                peak_allocated_bytes=300 * gpu.MIB, peak_reserved_bytes=512 * gpu.MIB,
                kv_bytes=3 * gpu.MIB, bucket_graphs=warmed if compiled else {})
    if cuda_graphs:
        base.update(cudagraphs_recorded=12, cudagraphs_replayed=480,
                    cudagraphs_recorded_after_warmup=0, torch_recordings_after_warmup=0)
    base.update(changes)
    return gpu.ModeResult(**base)  # type: ignore[arg-type]


class FakeRunner:
    """Canned results per (mode, dtype); `changes` alters one of them."""

    def __init__(self, changes: Mapping[tuple[str, str], Mapping[str, object]] | None = None,
                 seconds_per_mode: float = 1.0) -> None:
        self.changes = changes or {}
        self.calls: list[tuple[str, str]] = []
        self.now = 0.0
        self.seconds_per_mode = seconds_per_mode

    def clock(self) -> float:
        return self.now

    def device(self) -> str:
        return "Fake GPU, 1 GiB"

    def texts(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in GROUPS.items()}

    def reference(self, texts: Sequence[str]) -> dict[str, tuple[int, ...]]:
        return {t: REFERENCE[t] for t in texts}

    def run_mode(self, mode, dtype, groups) -> gpu.ModeResult:
        self.calls.append((mode, dtype))
        self.now += self.seconds_per_mode
        return _result(mode, dtype, **self.changes.get((mode, dtype), {}))

    def run_hf(self, dtype, groups) -> list[gpu.HFTiming]:
        self.calls.append(("hf", dtype))
        return [gpu.HFTiming(label, 80.0, 80.0 / 3) for label in groups]

    def run_batched(self, mode, dtype, texts, callers) -> gpu.BatchedThroughput:
        self.calls.append((f"batched {mode}", dtype))
        self.now += self.seconds_per_mode
        return gpu.BatchedThroughput(mode=mode, dtype=dtype, callers=callers,
                                     requests=len(texts) * 2, rps_one=20.0, rps_batched=90.0,
                                     equal_outputs=len(texts) * 2 - 1)


def _run(tmp_path, runner: FakeRunner, **kwargs: object) -> gpu.Report:
    lines: list[str] = []
    rep = gpu.run_check(runner, ["default", "reduce-overhead"], "bfloat16", tmp_path,
                        clock=runner.clock, log=lines.append, **kwargs)  # type: ignore[arg-type]
    assert lines[-1] == (tmp_path / "summary.md").read_text()  # printed and written: one text
    return rep


def test_a_clean_run_passes_with_one_table(tmp_path):
    runner = FakeRunner()
    rep = _run(tmp_path, runner)
    assert rep.exit_code == 0 and rep.problems == ()
    # float32 eager (the exactness rule), eager and each compiled mode in bf16, then HF.
    assert runner.calls == [("eager", "float32"), ("eager", "bfloat16"),
                            ("default", "bfloat16"), ("reduce-overhead", "bfloat16"),
                            ("hf", "bfloat16")]
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("GPU check ") and "Fake GPU, 1 GiB" in text
    assert "| bucket | mode | ms/request | ms/token | spec ms/request | speedup vs eager |" in text
    assert text.rstrip().endswith("all checks passed")
    assert gpu.NA_CUDAGRAPHS not in text  # reduce-overhead ran with CUDA graphs
    rows = [r for r in rep.rows if r["bucket"] == "16"]
    assert [r["mode"] for r in rows] == ["eager (float32)", "eager (bfloat16)",
                                         "default (bfloat16)", "reduce-overhead (bfloat16)",
                                         "HF generate()"]
    default = rows[2]
    assert default["ms/request"] == "10.00" and default["speedup vs eager"] == "4.00x"
    assert default["peak alloc MiB"] == "300.0" and default["KV MiB"] == "3.0"
    assert default["CUDA graphs rec/replay"] == "n/a" and default["paths"] == "compiled"
    assert rows[3]["CUDA graphs rec/replay"] == "12/480"
    assert rows[-1]["speedup vs eager"] == "0.50x"  # HF against bf16 eager: slower
    assert (tmp_path / "results.json").is_file()


def test_a_bucket_that_silently_ran_eager_fails_the_check(tmp_path):
    eager_32 = gpu.BucketTiming("32", 4, 40.0, 13.0, 30.0, ("compiled", "eager"))
    runner = FakeRunner({("reduce-overhead", "bfloat16"): {
        "buckets": (_result("default", "bfloat16").buckets[0], eager_32)}})
    rep = _run(tmp_path, runner)
    assert rep.exit_code == 1
    assert rep.problems == ("reduce-overhead: bucket 32 served eager instead of compiled "
                            "(an eager fallback)",)
    text = (tmp_path / "summary.md").read_text()
    assert "FAILED (1):" in text and "- reduce-overhead: bucket 32 served eager" in text


def test_a_bucket_whose_warm_up_fell_back_to_eager_fails_the_check(tmp_path):
    """The warm-up failed for bucket 32 (its requests would serve eager): named, exit 1,
    whichever compiled mode it was."""
    for mode in ("default", "reduce-overhead"):
        graphs = {**_result(mode, "bfloat16").bucket_graphs,
                  "32": "eager: RuntimeError: CUDA graph output overwritten"}
        problems = gpu.problems_of(_result(mode, "bfloat16", bucket_graphs=graphs), REFERENCE)
        assert problems == [f"{mode}: bucket 32's warm-up fell back to eager: eager: "
                            "RuntimeError: CUDA graph output overwritten"]
    runner = FakeRunner({("default", "bfloat16"): {"bucket_graphs": {"16": "eager: boom"}}})
    assert _run(tmp_path, runner).exit_code == 1


def test_cuda_graphs_that_did_not_replay_fail_the_check():
    base = _result("reduce-overhead", "bfloat16")
    recorded = (replace(base.buckets[0], cudagraph=("recorded", "replayed")),)
    cases = {
        "the runtime ran without CUDA graphs": dict(cudagraphs_recorded=None),
        "3 CUDA graph(s) recorded after warm-up": dict(cudagraphs_recorded_after_warmup=3),
        "cudagraph trees recorded 8 CUDA graph(s) after warm-up": dict(
            torch_recordings_after_warmup=8),
        "bucket 16: a request recorded a CUDA graph": dict(buckets=recorded),
        "bucket 16: no CUDA graph recorded (no CUDA graphs: cpu device)": dict(
            bucket_graphs={**base.bucket_graphs, "16": "no CUDA graphs: cpu device"}),
    }
    for said, changes in cases.items():
        problems = gpu.problems_of(replace(base, **changes), REFERENCE)  # type: ignore[arg-type]
        assert len(problems) == 1 and said in problems[0], (said, problems)
    # The default mode makes no CUDA graphs: nothing to replay, nothing wrong.
    assert gpu.problems_of(_result("default", "bfloat16"), REFERENCE) == []


def test_overflow_and_eager_mode_paths_are_not_fallbacks():
    overflow = gpu.BucketTiming("overflow", 2, 50.0, 15.0, None, ("overflow",))
    assert gpu.problems_of(_result("default", "bfloat16", buckets=(overflow,)), REFERENCE) == []
    assert gpu.problems_of(_result("eager", "bfloat16"), REFERENCE) == []


def test_each_failed_check_is_named():
    base = _result("reduce-overhead", "bfloat16")
    wrong = {t: (9, 1) for t in list(REFERENCE)[:3]}  # 3 of 4 differ: under half agree
    cases = {
        "warm-up failed: boom": dict(warm_error="boom"),
        "2 compile failure(s)": dict(compile_failures=2),
        "1 recompile(s) after warm-up": dict(recompiles_after_warmup=1),
        "3 graph(s) skipped by cudagraph trees": dict(cudagraph_skips=3),
        "speculative output differs": dict(buckets=(replace(base.buckets[0], spec_equal=False),)),
        "1 of 4 outputs equal float32's (at least 2 required)": dict(
            outputs={**REFERENCE, **wrong}),
    }
    for said, changes in cases.items():
        problems = gpu.problems_of(replace(base, **changes), REFERENCE)  # type: ignore[arg-type]
        assert len(problems) == 1 and said in problems[0], (said, problems)
    # float32 must equal the CPU exactly; bfloat16 only on half the inputs.
    one_off = {**REFERENCE, "a b": (7, 1)}
    assert gpu.problems_of(_result("eager", "float32", outputs=one_off), REFERENCE) == [
        "eager float32: 1 of 4 outputs differ from the CPU's float32 (must be equal)"]
    assert gpu.problems_of(_result("default", "bfloat16", outputs=one_off), REFERENCE) == []
    # Skips count only where CUDA graphs are the point.
    assert gpu.problems_of(_result("default", "bfloat16", cudagraph_skips=3), REFERENCE) == []


def test_a_spent_budget_fails_naming_what_did_not_run(tmp_path):
    runner = FakeRunner(seconds_per_mode=200.0)
    rep = _run(tmp_path, runner, budget_s=350.0)
    assert rep.exit_code == 1
    assert runner.calls == [("eager", "float32"), ("eager", "bfloat16")]
    assert rep.problems == (
        "default (bfloat16): not run (the 350 s budget was spent)",
        "reduce-overhead (bfloat16): not run (the 350 s budget was spent)",
        "HF generate(): not run (the 350 s budget was spent)")


def test_no_cuda_exits_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", "unused"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="with CUDA the script runs the whole check")
def test_the_script_runs_the_check_with_the_given_python(tmp_path):
    """scripts/gpu_check.sh: no wheels to install, bench.gpu's exit status (2: no CUDA here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels")}
    done = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "bench.gpu: CUDA is not available" in done.stdout + done.stderr
    assert (tmp_path / "out" / "log.txt").is_file()


def test_batched_throughput_is_reported_after_the_table_and_judges_nothing(tmp_path):
    import json

    runner = FakeRunner()
    rep = _run(tmp_path, runner, batch=8)
    assert runner.calls[-2:] == [("batched eager", "bfloat16"), ("batched default", "bfloat16")]
    assert rep.exit_code == 0  # one batched output that differs is reported, not failed
    assert ("batched throughput, default (bfloat16), max_batch 8: 20.0 requests/s with 1 "
            "caller, 90.0 with 8 (4.50x); 7 of 8 outputs equal one at a time's; 0 "
            "recompile(s) while batched") in rep.notes
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [b["mode"] for b in saved["batched"]] == ["eager", "default"]


def test_batched_throughput_past_the_budget_is_a_note_not_a_failure(tmp_path):
    runner = FakeRunner(seconds_per_mode=10.0)
    # Four modes take 40 s (HF none); the first batched step starts inside 45 s, the second not.
    rep = _run(tmp_path, runner, batch=8, budget_s=45.0)
    assert ("batched eager", "bfloat16") in runner.calls
    assert ("batched default", "bfloat16") not in runner.calls
    assert rep.exit_code == 0
    assert any(n.startswith("batched throughput not measured for default") for n in rep.notes)


def test_results_are_saved_after_every_step(tmp_path):
    """A run its time limit stops still leaves what it measured in results.json."""
    import json

    seen: list[list[str]] = []

    class Watching(FakeRunner):
        def run_mode(self, mode, dtype, groups):
            if (tmp_path / "results.json").exists():
                saved = json.loads((tmp_path / "results.json").read_text())
                seen.append([r["mode"] for r in saved["results"]])
            return super().run_mode(mode, dtype, groups)

    _run(tmp_path, Watching())
    assert seen == [[gpu.EAGER], [gpu.EAGER, gpu.EAGER], [gpu.EAGER, gpu.EAGER, "default"]]


def test_recompiles_after_warm_up_name_their_guard_failures():
    result = _result("default", "bfloat16", recompiles_after_warmup=3, recompile_reasons={
        "tensor 'cache' size mismatch at index 1": 2, "grad_mode mismatch": 1})
    assert gpu.problems_of(result, REFERENCE) == [
        "default: 3 recompile(s) after warm-up (must be 0): 2x tensor 'cache' size mismatch "
        "at index 1; 1x grad_mode mismatch"]


def test_new_reasons_are_the_ones_counted_after_warm_up():
    assert gpu._new_reasons({"a": 2, "b": 1}, {"a": 3, "b": 1, "c": 4}) == {"a": 1, "c": 4}


def test_the_script_measures_batched_reduce_overhead_when_it_runs_that_mode(monkeypatch,
                                                                            tmp_path):
    import torch

    seen: list[tuple[str, ...]] = []

    def check(runner, modes, dtype, out_dir, **kwargs):
        seen.append(tuple(kwargs["batched_modes"]))
        return gpu.Report(device="fake", rows=(), problems=())

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "run_check", check)
    assert gpu.main(["--out", str(tmp_path)]) == 0
    assert gpu.main(["--out", str(tmp_path), "--modes", "default"]) == 0
    assert seen == [("eager", "default", "reduce-overhead"), ("eager", "default")]


def test_batched_cuda_graphs_recorded_after_warm_up_are_reported(tmp_path):
    class Graphs(FakeRunner):
        def run_batched(self, mode, dtype, texts, callers):
            b = super().run_batched(mode, dtype, texts, callers)
            return replace(b, recorded_after_warmup=0 if mode == "reduce-overhead" else None)

    runner = Graphs()
    rep = _run(tmp_path, runner, batch=8,
               batched_modes=("eager", "default", "reduce-overhead"))
    assert runner.calls[-1] == ("batched reduce-overhead", "bfloat16")
    assert rep.exit_code == 0
    lines = [n for n in rep.notes if n.startswith("batched throughput")]
    assert lines[-1].endswith("0 recompile(s) while batched; 0 CUDA graph(s) recorded after "
                              "warm-up")
    assert "CUDA graph" not in lines[1]  # default: no CUDA graphs, nothing said


def test_the_batched_step_on_the_cpu_mixes_real_and_synthetic_and_keeps_every_output(
        monkeypatch):
    # The real runner's smoke run (compile off: the compiler is not what is checked): the
    # mixed round preempts synthetic rows, and every output is the one-caller output. Its
    # dynamo reset would drop the compiled code of this process's other runtimes.
    import torch

    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    runner = gpu.TorchRunner(buckets=(16, 32), inputs=2, new=8, repeats=1, device="cpu")
    texts = [t for group in runner.texts().values() for t in group]
    b = runner.run_batched(gpu.EAGER, "float32", texts, 2)
    assert b.equal_outputs == b.requests and b.recorded_after_warmup is None
    assert b.mixed_requests == b.requests and b.mixed_equal == b.mixed_requests
    assert b.preemptions > 0
    assert gpu.batched_line(b).endswith(
        f"real and synthetic mixed, 4 callers: {b.preemptions} preemption(s), "
        f"{b.mixed_requests} of {b.mixed_requests} outputs equal")
