"""The GPU check in one short run: compiled vs eager vs HF generate() on CUDA, one table.

    python -m bench.gpu [--out DIR] [--buckets 16,32,64,128,256] [--inputs 3] [--new 32]
                        [--dtype bfloat16] [--max-autotune] [--budget-s 420] [--batch 8]

(scripts/gpu_check.sh runs it with the GPU image's own python3.) Per bucket and compile
mode (`eager` = compile off, `default`, `reduce-overhead`; `max-autotune` only with
--max-autotune), on the built-in model: ms per request and per output token (direct, median),
speculative ms per request, HF `generate()` on the same GPU and dtype, graphs compiled,
CUDA graphs recorded / replayed (the runtime's Engine.graph_snapshot; n/a in a mode without
CUDA graphs) and cudagraph-tree skips, recompiles after warm-up, peak allocated / reserved
CUDA memory and KV bytes. Then, while the budget lasts, batched throughput (engine.max_batch
--batch) in eager, `default` and (when it is among the modes) `reduce-overhead`: requests per
second with one caller and with --batch callers at once (closed loop over every input), and
how many batched outputs equal the same engine's one-at-a-time outputs (reported, not judged:
a batched bfloat16 matmul may round otherwise). A compiled mode's batched steps run the
fixed-row compiled step (engine.t5.decode_fixed: one graph per batch-size class, CUDA graphs
under reduce-overhead). Then 2 x --batch callers at once, every other request synthetic (a
canary): the preemptions (real requests granted the extra row while synthetic rows pause)
and how many of those outputs equal one at a time's. The CUDA graphs recorded after
warm-up, both rounds included, are reported.
Correctness, with the tolerance rule of tests/engine/test_gpu.py: float32 on the GPU
(eager) gives exactly the CPU float32 tokens; each bfloat16 mode agrees with them on at
least half the inputs; speculative output equals direct output everywhere.

Exit status: 0 all checks passed; 1 a check failed (a compiled bucket that served eager or
whose warm-up fell back to eager, a warm-up error or compile failure, recompiles after
warm-up; under a CUDA-graph mode: a bucket whose warm-up recorded no CUDA graph, a graph
recorded after warm-up or a request that did not replay, a cudagraph skip; a correctness
rule); 2 no CUDA. The table and the checks are printed and
written to DIR/summary.md (DIR/results.json holds the numbers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from engine.protocol import PATH_EAGER  # the contract only: no torch

EAGER = "eager"  # compile_mode "off": the baseline every compiled mode is compared with
MIB = 2**20
NA_CUDAGRAPHS = ("CUDA graphs recorded / replayed: n/a: no mode ran with CUDA graphs "
                 "(cudagraph-tree skips are counted from torch's own counters)")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # engine.models.CUDAGRAPH_MODES


@dataclass(frozen=True)
class BucketTiming:
    """One compile mode on one bucket's inputs."""

    bucket: str
    requests: int
    ms_per_request: float  # direct decoding, median
    ms_per_token: float  # direct, median over requests of total time / output tokens
    spec_ms_per_request: float | None  # speculative decoding, median (None: no draft)
    paths: tuple[str, ...]  # the paths the requests were served on (engine.protocol.PATHS)
    spec_equal: bool = True  # speculative output ids == direct output ids on every input
    # What the requests' compiled calls did (GenerateResult.cudagraph: replayed, recorded,
    # none), each value once.
    cudagraph: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModeResult:
    """One engine (one compile mode and dtype) through warm-up and the measured requests."""

    mode: str
    dtype: str
    buckets: tuple[BucketTiming, ...]
    outputs: Mapping[str, tuple[int, ...]]  # text -> direct output ids
    warm_up_s: float = 0.0
    warm_error: str | None = None
    graphs: int = 0
    recompiles_after_warmup: int = 0
    # Guard failures behind those recompiles (engine.compile_watch's normalized reasons).
    recompile_reasons: Mapping[str, int] = field(default_factory=dict)
    compile_failures: int = 0
    cudagraphs_recorded: int | None = None  # None: the mode ran without CUDA graphs
    cudagraphs_replayed: int | None = None
    cudagraphs_recorded_after_warmup: int | None = None
    # torch's own count of recordings (cudagraph trees record per tree position, which a
    # signature the ledger has seen can still need): every one after warm-up.
    torch_recordings_after_warmup: int | None = None
    # str(bucket edge) -> what its warm-up left (WarmupStatus.bucket_graphs).
    bucket_graphs: Mapping[str, str] = field(default_factory=dict)
    cudagraph_skips: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    kv_bytes: int | None = None


@dataclass(frozen=True)
class BatchedThroughput:
    """One engine with the batching scheduler, closed loop: 1 caller, then `callers` at once."""

    mode: str
    dtype: str
    callers: int
    requests: int
    rps_one: float
    rps_batched: float
    equal_outputs: int  # batched outputs equal to the one-caller outputs (of `requests`)
    recompiles: int = 0  # during the batched requests (row counts warm-up did not cover)
    # CUDA graphs the engine recorded after its warm-up (None: the mode runs without them)
    recorded_after_warmup: int | None = None
    # Then 2 x `callers` at once, every other request synthetic (a canary): real ones that
    # found the rows held take the extra row and synthetic rows pause (engine.scheduler).
    mixed_requests: int = 0
    mixed_equal: int = 0  # of them, outputs equal to the one-caller outputs
    preemptions: int = 0

    @property
    def ratio(self) -> float:
        return self.rps_batched / self.rps_one if self.rps_one > 0 else 0.0


@dataclass(frozen=True)
class HFTiming:
    """HF generate() on one bucket's inputs (same GPU, dtype and inputs)."""

    bucket: str
    ms_per_request: float
    ms_per_token: float


@dataclass(frozen=True)
class Report:
    """The table, the checks that failed and the notes, from a run's results."""

    device: str
    rows: tuple[dict[str, str], ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0


class Runner(Protocol):
    """What the check runs: the real one drives torch and the engine; tests pass a fake."""

    def device(self) -> str: ...

    def texts(self) -> dict[str, list[str]]: ...

    def reference(self, texts: Sequence[str]) -> dict[str, tuple[int, ...]]: ...

    def run_mode(self, mode: str, dtype: str, groups: Mapping[str, Sequence[str]]
                 ) -> ModeResult: ...

    def run_hf(self, dtype: str, groups: Mapping[str, Sequence[str]]) -> list[HFTiming]: ...

    def run_batched(self, mode: str, dtype: str, texts: Sequence[str], callers: int
                    ) -> BatchedThroughput: ...


# --- the check's logic (no torch) -----------------------------------------------------


def problems_of(result: ModeResult, reference: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Return what is wrong with one mode's run (empty: it passed)."""
    out: list[str] = []
    mode = result.mode
    compiled = mode != EAGER
    if result.warm_error:
        out.append(f"{mode}: warm-up failed: {result.warm_error}")
    if compiled and result.compile_failures:
        out.append(f"{mode}: {result.compile_failures} compile failure(s): those requests "
                   "ran eager")
    if compiled:
        # "overflow" (past the largest bucket) is eager by design; "eager" on a bucket is not.
        for b in result.buckets:
            if PATH_EAGER in b.paths:
                out.append(f"{mode}: bucket {b.bucket} served eager instead of compiled "
                           "(an eager fallback)")
    if compiled:
        for label, graphs in result.bucket_graphs.items():
            if graphs.startswith("eager"):
                out.append(f"{mode}: bucket {label}'s warm-up fell back to eager: {graphs}")
            elif mode in CUDAGRAPH_MODES and not graphs.startswith("recorded"):
                out.append(f"{mode}: bucket {label}: no CUDA graph recorded ({graphs})")
    if mode in CUDAGRAPH_MODES:
        out += _cudagraph_problems(result)
    if compiled and result.recompiles_after_warmup:
        top = sorted(result.recompile_reasons.items(), key=lambda kv: -kv[1])[:3]
        why = "; ".join(f"{n}x {reason}" for reason, n in top) or "no guard failure recorded"
        out.append(f"{mode}: {result.recompiles_after_warmup} recompile(s) after warm-up "
                   f"(must be 0): {why}")
    if mode == "reduce-overhead" and result.cudagraph_skips:
        out.append(f"{mode}: {result.cudagraph_skips} graph(s) skipped by cudagraph trees "
                   "(run without CUDA graphs; TORCH_LOGS=cudagraphs says why)")
    for b in result.buckets:
        if not b.spec_equal:
            out.append(f"{mode}: bucket {b.bucket}: speculative output differs from direct")
    texts = [t for t in result.outputs if t in reference]
    agree = sum(result.outputs[t] == reference[t] for t in texts)
    if result.dtype == "float32" and agree != len(texts):
        out.append(f"{mode} float32: {len(texts) - agree} of {len(texts)} outputs differ from "
                   "the CPU's float32 (must be equal)")
    elif result.dtype != "float32" and texts and agree < len(texts) // 2:
        out.append(f"{mode} {result.dtype}: {agree} of {len(texts)} outputs equal float32's "
                   f"(at least {len(texts) // 2} required)")
    return out


def _cudagraph_problems(result: ModeResult) -> list[str]:
    """Return what shows a CUDA-graph mode's requests did not all replay recorded graphs."""
    mode, out = result.mode, []
    if result.cudagraphs_recorded is None:
        out.append(f"{mode}: the runtime ran without CUDA graphs")
    if result.cudagraphs_recorded_after_warmup:
        out.append(f"{mode}: {result.cudagraphs_recorded_after_warmup} CUDA graph(s) recorded "
                   "after warm-up (must be 0: the warm-up missed a cache, span or thread)")
    if result.torch_recordings_after_warmup:
        out.append(f"{mode}: cudagraph trees recorded {result.torch_recordings_after_warmup} "
                   "CUDA graph(s) after warm-up (must be 0: a compiled call at a tree position "
                   "the warm-up never reached)")
    for b in result.buckets:
        if "recorded" in b.cudagraph:
            out.append(f"{mode}: bucket {b.bucket}: a request recorded a CUDA graph instead "
                       "of replaying one")
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


COLUMNS = ("bucket", "mode", "ms/request", "ms/token", "spec ms/request", "speedup vs eager",
           "graphs", "CUDA graphs rec/replay", "torch recordings after warm-up", "cudagraph skips",
           "recompiles after warm-up",
           "peak alloc MiB", "peak reserved MiB", "KV MiB", "paths")


def rows_of(results: Sequence[ModeResult], hf: Sequence[HFTiming]) -> list[dict[str, str]]:
    """Return the table's rows: per bucket, each mode and then HF generate()."""
    # Each mode is compared with eager in its own dtype (float32 eager is the exactness run).
    eager = {(b.bucket, r.dtype): b for r in results if r.mode == EAGER for b in r.buckets}
    hf_dtype = results[-1].dtype if results else ""  # HF runs in the run's dtype: the last
    order: list[str] = []
    for r in results:
        order += [b.bucket for b in r.buckets if b.bucket not in order]
    order += [h.bucket for h in hf if h.bucket not in order]
    rows: list[dict[str, str]] = []
    for label in order:
        for r in results:
            for b in r.buckets:
                if b.bucket != label:
                    continue
                base = eager.get((label, r.dtype))
                vs = (f"{base.ms_per_request / b.ms_per_request:.2f}x"
                      if base is not None and b.ms_per_request > 0 else "-")
                rows.append({
                    "bucket": label, "mode": f"{r.mode} ({r.dtype})",
                    "ms/request": _ms(b.ms_per_request), "ms/token": _ms(b.ms_per_token),
                    "spec ms/request": _ms(b.spec_ms_per_request), "speedup vs eager": vs,
                    "graphs": str(r.graphs),
                    "CUDA graphs rec/replay": (
                        f"{_count(r.cudagraphs_recorded)}/{_count(r.cudagraphs_replayed)}"
                        if r.cudagraphs_recorded is not None else "n/a"),
                    "torch recordings after warm-up": _count(r.torch_recordings_after_warmup),
                    "cudagraph skips": _count(r.cudagraph_skips),
                    "recompiles after warm-up": str(r.recompiles_after_warmup),
                    "peak alloc MiB": _mib(r.peak_allocated_bytes),
                    "peak reserved MiB": _mib(r.peak_reserved_bytes),
                    "KV MiB": _mib(r.kv_bytes), "paths": ",".join(b.paths)})
        for h in hf:
            if h.bucket == label:
                base = eager.get((label, hf_dtype))
                rows.append({c: "-" for c in COLUMNS} | {
                    "bucket": label, "mode": "HF generate()",
                    "ms/request": _ms(h.ms_per_request), "ms/token": _ms(h.ms_per_token),
                    "speedup vs eager": (f"{base.ms_per_request / h.ms_per_request:.2f}x"
                                 if base is not None and h.ms_per_request > 0 else "-")})
    return rows


def table(rows: Sequence[Mapping[str, str]]) -> str:
    """Return the rows as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row.get(c, "-") for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def batched_line(b: BatchedThroughput) -> str:
    """Return one batched-throughput result as a line of the summary."""
    return (f"batched throughput, {b.mode} ({b.dtype}), max_batch {b.callers}: "
            f"{b.rps_one:.1f} requests/s with 1 caller, {b.rps_batched:.1f} with {b.callers} "
            f"({b.ratio:.2f}x); {b.equal_outputs} of {b.requests} outputs equal one at a "
            f"time's; {b.recompiles} recompile(s) while batched"
            + ("" if not b.mixed_requests
               else f"; real and synthetic mixed, {2 * b.callers} callers: "
                    f"{b.preemptions} preemption(s), {b.mixed_equal} of {b.mixed_requests} "
                    f"outputs equal")
            + ("" if b.recorded_after_warmup is None
               else f"; {b.recorded_after_warmup} CUDA graph(s) recorded after warm-up"))


def report(device: str, results: Sequence[ModeResult], hf: Sequence[HFTiming],
           reference: Mapping[str, tuple[int, ...]], skipped: Sequence[str] = (),
           batched: Sequence[BatchedThroughput] = ()) -> Report:
    """Judge a run: the table's rows, every failed check, and what could not be measured."""
    problems: list[str] = [f"{mode}: not run ({why})" for mode, why in
                           (s.split(": ", 1) for s in skipped)]
    for r in results:
        problems += problems_of(r, reference)
    notes = []
    if all(r.cudagraphs_recorded is None for r in results):
        notes.append(NA_CUDAGRAPHS)
    notes += [batched_line(b) for b in batched]
    return Report(device=device, rows=tuple(rows_of(results, hf)), problems=tuple(problems),
                  notes=tuple(notes))


def summary(rep: Report, when: str) -> str:
    """Return the summary file's text: the device, the table, the checks."""
    out = [f"GPU check {when}, {rep.device}", "", table(rep.rows), ""]
    out += [f"note: {n}" for n in rep.notes]
    if rep.problems:
        out += ["", f"FAILED ({len(rep.problems)}):"] + [f"- {p}" for p in rep.problems]
    else:
        out += ["", "all checks passed"]
    return "\n".join(out) + "\n"


def run_check(runner: Runner, modes: Sequence[str], dtype: str, out_dir: Path, *,
              budget_s: float = float("inf"), clock: Callable[[], float] = time.monotonic,
              log: Callable[[str], None] = print, batch: int = 0,
              batched_modes: Sequence[str] = (EAGER, "default")) -> Report:
    """Run every mode and HF generate() through `runner`, judge, print and write the table.

    `batch` > 1: then batched throughput (each of `batched_modes` in turn) while the budget
    lasts.
    results.json is rewritten after every step, so a run stopped by its time limit still
    leaves what it measured.
    """
    start = clock()
    groups = runner.texts()
    texts = [t for group in groups.values() for t in group]
    log(f"[{clock() - start:6.1f}s] float32 reference on the CPU ({len(texts)} inputs)")
    reference = runner.reference(texts)
    results: list[ModeResult] = []
    hf: list[HFTiming] = []
    batched: list[BatchedThroughput] = []
    skipped: list[str] = []

    def spent() -> bool:
        return clock() - start > budget_s

    def save() -> None:
        _write(out_dir, runner.device(), results, hf, batched, round(clock() - start, 1))

    # float32 eager on the GPU first (the exact-equality rule), then eager and each compiled
    # mode in `dtype`.
    plan = [(EAGER, "float32")] if dtype != "float32" else []
    plan += [(EAGER, dtype)] + [(mode, dtype) for mode in modes]
    for mode, dt in plan:
        if spent():
            skipped.append(f"{mode} ({dt}): the {budget_s:.0f} s budget was spent")
            continue
        log(f"[{clock() - start:6.1f}s] {mode} ({dt})")
        results.append(runner.run_mode(mode, dt, groups))
        save()
    if not spent():
        log(f"[{clock() - start:6.1f}s] HF generate() ({dtype})")
        hf = runner.run_hf(dtype, groups)
        save()
    else:
        skipped.append(f"HF generate(): the {budget_s:.0f} s budget was spent")
    unmeasured: list[str] = []
    for mode in (batched_modes if batch > 1 else ()):
        if spent():
            unmeasured.append(mode)
            continue
        log(f"[{clock() - start:6.1f}s] batched throughput, {mode} ({dtype}), {batch} callers")
        batched.append(runner.run_batched(mode, dtype, texts, batch))
        save()
    rep = report(runner.device(), results, hf, reference, skipped, batched)
    if unmeasured:  # optional: a note, not a failed check
        rep = replace(rep, notes=rep.notes + (
            f"batched throughput not measured for {', '.join(unmeasured)}: the "
            f"{budget_s:.0f} s budget was spent",))
    text = summary(rep, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    log(text)
    (out_dir / "summary.md").write_text(text)
    _write(out_dir, rep.device, results, hf, batched, round(clock() - start, 1),
           problems=rep.problems)
    return rep


def _write(out_dir: Path, device: str, results: Sequence[ModeResult],
           hf: Sequence[HFTiming], batched: Sequence[BatchedThroughput], seconds: float,
           problems: Sequence[str] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(
        {"device": device, "results": [_jsonable(r) for r in results],
         "hf": [asdict(h) for h in hf], "batched": [asdict(b) for b in batched],
         "problems": None if problems is None else list(problems), "seconds": seconds},
        indent=1))


def _new_reasons(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """Return the reasons counted in `after` beyond `before`."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def _jsonable(result: ModeResult) -> dict[str, object]:
    data = asdict(result)
    data["outputs"] = {t: list(ids) for t, ids in result.outputs.items()}
    return data


# --- the real runner (torch, CUDA) ----------------------------------------------------


class TorchRunner:
    """Run the engine and HF generate() on CUDA with the built-in models (`device` "cpu":
    the same code on the CPU, a smoke run of this script where there is no GPU)."""

    def __init__(self, buckets: tuple[int, ...], inputs: int, new: int, repeats: int,
                 device: str = "cuda") -> None:
        self.buckets, self.inputs, self.new, self.repeats = buckets, inputs, new, repeats
        self.on = device
        self.cuda = device.startswith("cuda")

    def device(self) -> str:
        import platform

        import torch

        if not self.cuda:
            return (f"CPU {platform.processor() or platform.machine()} (a smoke run, not GPU "
                    f"numbers), torch {torch.__version__}, Python {sys.version.split()[0]}")
        p = torch.cuda.get_device_properties(0)
        return (f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, Python {sys.version.split()[0]}")

    def _config(self, **changes: object):
        from engine.config import EngineConfig

        base: dict[str, object] = dict(buckets=self.buckets, max_new_tokens=self.new,
                                       speculative_fallback=False)
        base.update(changes)
        return EngineConfig(**base)  # type: ignore[arg-type]

    def texts(self) -> dict[str, list[str]]:
        from bench.engine import _canaries, by_bucket
        from engine import load_engine

        probe = load_engine(self._config(device="cpu", compile_mode="off"))
        try:
            return by_bucket(probe, _canaries("in_domain"), self.inputs)
        finally:
            probe.close()

    def reference(self, texts: Sequence[str]) -> dict[str, tuple[int, ...]]:
        from engine import load_engine
        from engine.protocol import FlagOverride

        cpu = load_engine(self._config(device="cpu", dtype="float32", compile_mode="off"))
        try:
            return {t: cpu.generate(t, max_new_tokens=self.new,
                                    override=FlagOverride(speculative=False)).output_ids
                    for t in texts}
        finally:
            cpu.close()

    def run_mode(self, mode: str, dtype: str, groups: Mapping[str, Sequence[str]]
                 ) -> ModeResult:
        import torch
        from torch._dynamo.utils import counters

        from engine import load_engine
        from engine.compile_watch import shared_watch
        from engine.protocol import FlagOverride

        torch._dynamo.reset()  # each mode compiles its own graphs (and cudagraph trees)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        # The compile counters are per process: this mode's are the differences.
        start = shared_watch().snapshot()
        skips0 = counters["inductor"].get("cudagraph_skips", 0)
        engine = load_engine(self._config(device=self.on, dtype=dtype,
                                          compile_mode="off" if mode == EAGER else mode))
        try:
            t0 = time.perf_counter()
            engine.warm_up(background=False)
            warm_s = time.perf_counter() - t0
            status = engine.warmup_status()
            before = engine.compile_snapshot()
            timings, outputs = [], {}
            for label, texts in groups.items():
                direct_s, per_token, spec_s, paths, equal = [], [], [], set(), True
                graphs: set[str] = set()
                for text in texts:
                    for _ in range(self.repeats):
                        d = engine.generate(text, override=FlagOverride(speculative=False))
                        direct_s.append(d.total_s)
                        per_token.append(d.total_s / max(d.output_tokens, 1))
                        paths.add(d.path)
                        graphs.add(d.cudagraph)
                        outputs[text] = d.output_ids
                        if engine.info.speculative_available:
                            s = engine.generate(text, override=FlagOverride(speculative=True))
                            spec_s.append(s.total_s)
                            paths.add(s.path)
                            graphs.add(s.cudagraph)
                            equal = equal and s.output_ids == d.output_ids
                timings.append(BucketTiming(
                    bucket=label, requests=len(direct_s),
                    ms_per_request=statistics.median(direct_s) * 1e3,
                    ms_per_token=statistics.median(per_token) * 1e3,
                    spec_ms_per_request=statistics.median(spec_s) * 1e3 if spec_s else None,
                    paths=tuple(sorted(paths)), spec_equal=equal,
                    cudagraph=tuple(sorted(graphs))))
            after = engine.compile_snapshot()
            mem = engine.memory_snapshot()
            g = engine.graph_snapshot()
            return ModeResult(
                mode=mode, dtype=dtype, buckets=tuple(timings), outputs=outputs,
                warm_up_s=warm_s, warm_error=status.error, graphs=after.graphs - start.graphs,
                recompiles_after_warmup=after.recompiles - before.recompiles,
                recompile_reasons=_new_reasons(before.recompile_reasons,
                                               after.recompile_reasons),
                compile_failures=after.compile_failures - start.compile_failures,
                cudagraphs_recorded=g.recorded if g.cudagraphs else None,
                cudagraphs_replayed=g.replayed if g.cudagraphs else None,
                torch_recordings_after_warmup=(
                    after.cudagraph_recordings - before.cudagraph_recordings
                    if g.cudagraphs else None),
                cudagraphs_recorded_after_warmup=(g.recorded_after_warmup if g.cudagraphs
                                                  else None),
                bucket_graphs=dict(status.bucket_graphs),
                cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0) - skips0),
                peak_allocated_bytes=(int(torch.cuda.max_memory_allocated())
                                      if self.cuda else None),
                peak_reserved_bytes=(int(torch.cuda.max_memory_reserved())
                                     if self.cuda else None),
                kv_bytes=mem.kv_peak_bytes)
        finally:
            engine.close()

    def run_hf(self, dtype: str, groups: Mapping[str, Sequence[str]]) -> list[HFTiming]:
        import torch
        from transformers import T5ForConditionalGeneration

        from engine.config import BUILTIN_DIR
        from engine.loader import load_model

        target = BUILTIN_DIR / "target"
        model = T5ForConditionalGeneration.from_pretrained(
            target, dtype=getattr(torch, dtype)).to(self.on).eval()
        tok = load_model(target).tokenizer  # the engine's tokenizer: the same input ids
        out = []
        for label, texts in groups.items():
            times, per_token = [], []
            for text in texts:
                ids = torch.tensor([tok(text).input_ids], device=self.on)
                for _ in range(self.repeats):
                    self._sync()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        gen = model.generate(ids, max_new_tokens=self.new, do_sample=False,
                                             num_beams=1)
                    self._sync()
                    dt = time.perf_counter() - t0
                    times.append(dt)
                    per_token.append(dt / max(gen.shape[1] - 1, 1))
            out.append(HFTiming(label, statistics.median(times) * 1e3,
                                statistics.median(per_token) * 1e3))
        return out

    def run_batched(self, mode: str, dtype: str, texts: Sequence[str], callers: int
                    ) -> BatchedThroughput:
        import torch

        from bench.throughput import closed_loop
        from engine import load_engine
        from engine.protocol import FlagOverride

        torch._dynamo.reset()
        engine = load_engine(self._config(device=self.on, dtype=dtype, max_batch=callers,
                                          compile_mode="off" if mode == EAGER else mode))
        try:
            engine.warm_up(background=False)
            direct = FlagOverride(speculative=False)
            one = {t: engine.generate(t, override=direct).output_ids for t in texts}
            batched: dict[str, list[tuple[int, ...]]] = {}

            def call(text: str, canary: bool = False) -> None:
                batched.setdefault(text, []).append(
                    engine.generate(text, override=direct, canary=canary).output_ids)

            sent = itertools.count()

            def mixed(text: str) -> None:
                call(text, canary=next(sent) % 2 == 1)

            requests = max(2 * len(texts), 4 * callers)
            before = engine.compile_snapshot()
            # Warm-up compiled (and recorded) every batch-size class: this first round only
            # settles the allocator and the caches before the measured ones.
            closed_loop(call, texts, callers, callers * 2)
            batched.clear()
            rps_one = closed_loop(call, texts, 1, requests)
            batched.clear()
            rps_batched = closed_loop(call, texts, callers, requests)
            equal = sum(ids == one[t] for t, outs in batched.items() for ids in outs)
            batched.clear()
            preempted = engine.admission_stats().preemptions
            closed_loop(mixed, texts, 2 * callers, requests)
            preemptions = engine.admission_stats().preemptions - preempted
            mixed_equal = sum(ids == one[t] for t, outs in batched.items() for ids in outs)
            recompiles = engine.compile_snapshot().recompiles - before.recompiles
            graphs = engine.graph_snapshot()
            return BatchedThroughput(mode=mode, dtype=dtype, callers=callers,
                                     requests=requests, rps_one=rps_one,
                                     rps_batched=rps_batched, equal_outputs=equal,
                                     recompiles=recompiles,
                                     recorded_after_warmup=graphs.recorded_after_warmup
                                     if graphs.cudagraphs else None,
                                     mixed_requests=requests, mixed_equal=mixed_equal,
                                     preemptions=preemptions)
        finally:
            engine.close()

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for summary.md and results.json "
                        "(default var/gpu-check-<UTC time>)")
    parser.add_argument("--buckets", default="16,32,64,128,256")
    parser.add_argument("--inputs", type=int, default=3, help="inputs per bucket")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new", type=int, default=32, help="max new tokens per request")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                "float32"))
    parser.add_argument("--modes", default="default,reduce-overhead",
                        help="compiled modes to run (eager always runs)")
    parser.add_argument("--max-autotune", action="store_true",
                        help="also run max-autotune (long: its own autotuning per kernel)")
    parser.add_argument("--batch", type=int, default=8,
                        help="callers for the batched-throughput step (engine.max_batch; "
                             "0: skip it)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke run
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new mode after this many seconds (then: a failed "
                             "check naming what did not run)")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench.gpu: CUDA is not available (torch {torch.__version__})", file=sys.stderr)
        return 2
    out = Path(args.out or f"var/gpu-check-{time.strftime('%Y%m%d-%H%M', time.gmtime())}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str((out / "inductor").resolve()))
    modes = [m for m in args.modes.split(",") if m]
    modes += ["max-autotune"] if args.max_autotune and "max-autotune" not in modes else []
    buckets = tuple(int(b) for b in args.buckets.split(","))
    runner = TorchRunner(buckets, args.inputs, args.new, args.repeats, args.device)
    # Batched: eager and default always, reduce-overhead (CUDA graphs of the fixed-row step)
    # when it runs at all, last: the budget may cut it.
    batched_modes = (EAGER, "default", *(m for m in modes if m == "reduce-overhead"))
    rep = run_check(runner, modes, args.dtype, out, budget_s=args.budget_s,
                    log=lambda line: print(line, flush=True), batch=args.batch,
                    batched_modes=batched_modes)
    return rep.exit_code


if __name__ == "__main__":
    sys.exit(main())
