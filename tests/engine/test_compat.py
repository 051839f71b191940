"""An older torch (the GPU image's 2.11): each missing feature is detected and the engine takes
the older path; exercised here by forcing the checks off."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import compat
from engine.protocol import FlagOverride
from engine.runner import CompileOptions, ModelRunner
from engine.runtime import Runtime
from tests.engine.conftest import tiny_config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Let later tests count graphs from zero (dynamo's counters are per process).

    Not torch._dynamo.reset(): it also drops the compile callbacks the engine's process-wide
    compile watch registered once, and later tests would see no recompile reasons.
    """
    yield
    from torch._dynamo.utils import counters

    counters.clear()


@pytest.fixture
def old_compile(monkeypatch):
    """torch.compile as torch 2.11 has it: no `recompile_limit` (a TypeError if passed)."""
    real = torch.compile

    def compile_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor",
                     mode=None, options=None, disable=False):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                    options=options, disable=disable)

    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(torch, "compile", compile_2_11)
    compat._detected.cache_clear()
    # The older path raises dynamo's process-wide limit: give later tests theirs back.
    with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit):
        yield
    monkeypatch.setattr(torch, "compile", real)
    compat._detected.cache_clear()


def test_detected_from_the_signature_and_forced_off():
    compat._detected.cache_clear()
    assert compat.has("compile_recompile_limit")  # the pinned torch has it
    with compat.forced_off("compile_recompile_limit"):
        assert not compat.has("compile_recompile_limit")
    assert compat.has("compile_recompile_limit")
    with pytest.raises(ValueError, match="feature: must be one of"):
        compat.has("no_such_feature")


def test_without_a_per_function_limit_the_process_limit_is_raised(tmp_path, tiny_dirs,
                                                                   old_compile):
    import torch._dynamo.config as dynamo_config

    assert not compat.has("compile_recompile_limit")
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", native_step=False,
                             recompile_limit=77, cache_dir=str(tmp_path / "cache")))
    kwargs = rt.target._compile_kwargs(saved=False)
    assert "recompile_limit" not in kwargs
    rt.warm_up(background=False)
    assert rt.warmup_status().error is None and rt.is_warm(8)
    assert dynamo_config.recompile_limit >= 77
    out = rt.generate("hello there", max_new_tokens=8, override=FlagOverride(speculative=True))
    assert out.path == "compiled" and out.output_ids


def test_without_aot_precompile_nothing_is_saved_and_it_says_why(tmp_path, tiny_dirs, caplog):
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", native_step=False,
                             cache_dir=str(tmp_path / "cache")))
    with compat.forced_off("aot_precompile"), caplog.at_level(logging.WARNING):
        assert rt.save_compiled() == 0
    said = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert said and all("has no AOT precompile" in line for line in said)
    assert rt.saved_dir is not None and not list(rt.saved_dir.glob("*"))


def test_inductor_options_this_torch_lacks_are_dropped(tiny_dirs, caplog):
    from engine.loader import load_model

    loaded = load_model(tiny_dirs["other"])
    from engine import t5

    lean = t5.LeanT5(loaded.config, loaded.weights, dtype=torch.float32,
                     device=torch.device("cpu"))
    options = CompileOptions("default", "inductor", 8,
                             (("realize_acc_reads_threshold", 1), ("no_such_option_in_torch", 3)))
    runner = ModelRunner(lean, edges=(8,), slots=8, verify_q=2, options=options, name="t")
    with caplog.at_level(logging.INFO, logger="engine.compat"):
        passed = runner._compile_kwargs(saved=False)["options"]
        runner._compile_kwargs(saved=False)
    assert passed["realize_acc_reads_threshold"] == 1 and "guard_filter_fn" in passed
    assert "no_such_option_in_torch" not in passed
    said = [r.getMessage() for r in caplog.records if r.name == "engine.compat"]
    assert len(said) == 1 and "no option 'no_such_option_in_torch'" in said[0]


def test_aot_precompile_is_detected_from_dynamos_own_switch():
    """torch 2.11 has the API but keeps it off (dynamo config enable_aot_compile = False)."""
    import torch._dynamo.config as dynamo_config

    compat._detected.cache_clear()
    assert compat.has("aot_precompile")
    # dynamo's own patch: monkeypatch's undo would delete the (hidden) config entry.
    compat._detected.cache_clear()
    try:
        with dynamo_config.patch(enable_aot_compile=False):
            assert not compat.has("aot_precompile")
    finally:
        compat._detected.cache_clear()
    assert dynamo_config.enable_aot_compile is True and compat.has("aot_precompile")
