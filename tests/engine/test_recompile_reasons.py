"""Recompile reasons are normalized at the source, so the same recompile aggregates."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from engine.compile_watch import (
    normalize_reason,
    shared_watch,
    specialize,
    top_recompile_reasons,
)


def _double(x):
    return x * 2


def test_same_recompile_in_several_frames_counts_more_than_once():
    watch = shared_watch()
    watch.attach()  # as a runner does before it first compiles
    before = watch.snapshot()
    # Three compiled copies (one frame each, like the per-bucket functions), each
    # recompiling for the same reason: a new input length.
    for i in range(3):
        fn = torch.compile(specialize(_double, f"reasons_{i}"), backend="eager", dynamic=False)
        fn(torch.ones(5))
        fn(torch.ones(6))
    delta = watch.snapshot().diff(before)
    assert delta.recompiles >= 3
    assert all(not re.match(r"\s*\[?\d+/\d+", k) for k in delta.recompile_reasons)
    top = top_recompile_reasons([delta.recompile_reasons])
    reason, count = top[0]
    assert count >= 3 and "size mismatch" in reason and "expected 5, actual 6" in reason


def test_normalize_keeps_the_guard_text_and_drops_ids():
    assert normalize_reason("0/1: tensor 'ids' size mismatch at index 1. expected 16, actual 17"
                            ) == "tensor 'ids' size mismatch at index 1. expected 16, actual 17"
    assert normalize_reason("[3/0_1] ___check_obj_id(L['m'], 140234567890123)\nnext line"
                            ) == "___check_obj_id(L['m'], <id>)"
    # Reasons stored before normalization merge with new ones.
    assert top_recompile_reasons([{"0/1: a": 1}, {"2/0: a": 2, "b": 1}]) == [("a", 3), ("b", 1)]


def test_a_cuda_graph_recording_is_counted_as_a_recording_not_a_recompile():
    from torch._dynamo import callback_handler
    from torch._dynamo.callback import CallbackTrigger

    watch = shared_watch()
    watch.attach()
    before = watch.snapshot()
    # What cudagraph trees do around each recording (the graph's own compile id, here
    # the second compile of frame 3), on CPU: the callback is the same on every device.
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "3/1"):
        pass
    after = watch.snapshot()
    assert after.recompiles == before.recompiles
    assert after.compile_seconds == before.compile_seconds
    assert after.cudagraph_recordings == before.cudagraph_recordings + 1



# In a process of its own: torch._dynamo.reset() also drops the compiled code of every
# runtime this test process keeps (the session's warm engines would compile again).
_AFTER_RESET = """
import torch, torch._dynamo.callback as callback
from engine.compile_watch import shared_watch, specialize

def double(x):
    return x * 2

def recompiles_of(name):
    watch = shared_watch()
    watch.attach()  # as each new runtime's runner does before it first compiles
    before = watch.snapshot()
    fn = torch.compile(specialize(double, name), backend="eager", dynamic=False)
    fn(torch.ones(5))
    fn(torch.ones(6))
    return watch.snapshot().diff(before).recompiles

first = recompiles_of("before_reset")
torch._dynamo.reset()
shared_watch().attach()
print(first, recompiles_of("after_reset"),
      callback.callback_handler.start_callbacks.count(shared_watch()._on_start))
"""


def test_recompiles_are_counted_again_after_dynamo_resets_its_callbacks():
    # torch._dynamo.reset() drops every compile callback (bench.gpu resets between modes):
    # the next runtime's attach puts the watch's back, once however often it is called.
    done = subprocess.run([sys.executable, "-c", _AFTER_RESET], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1", "1"]
