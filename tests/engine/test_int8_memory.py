"""What int8 serving holds: no second full float model, and a float32 arm that is float32.

An engine with `quantization: int8` keeps the float target's decoder-step weights, and its
encoder's products' (the int8 target has an int8 encoder of its own), only while float
requests hold them (engine.float_weights); released, the runtime's tensors
take no more bytes than a float32-only runtime's, and a float request reloads them from
the checkpoint: its tokens are a float32 runtime's, token for token.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import quantize
from engine.errors import EngineError, ModelLoadError
from engine.memory import held_tensors
from engine.protocol import PATH_COMPILED, REFERENCE, FlagOverride
from engine.runtime import Runtime
from tests.engine.conftest import random_texts, tiny_config

FLOAT32 = FlagOverride(quantized=False)


def _runtime(dirs: dict[str, Path], cache: Path, quantization: str) -> Runtime:
    # int8 with its own int8 encoder (unset, it is decided by measuring this host).
    int8 = {"int8_encoder": True} if quantization == "int8" else {}
    engine = Runtime(tiny_config(dirs, quantization=quantization, use_draft=False,
                                 flags_file="", cache_dir=str(cache), **int8))
    engine.warm_up(background=False)
    return engine


def _bytes(engine: Runtime) -> int:
    return sum(held_tensors(engine.models.runners()).values())


@pytest.fixture(scope="module")
def float32_and_int8(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Return a warm float32-only runtime and a warm int8 runtime of the tiny target."""
    cache = tmp_path_factory.mktemp("int8-memory-cache")
    f32 = _runtime(tiny_dirs, cache, "none")
    i8 = _runtime(tiny_dirs, cache, "int8")
    yield f32, i8
    f32.close()
    i8.close()


def test_int8_serving_holds_no_more_tensor_bytes_than_float32_serving(float32_and_int8):
    f32, i8 = float32_and_int8
    assert i8.target.native is not None and i8.target_q is not None
    weights = i8.target.weights
    assert weights is not None
    i8.generate("xabcx", override=FlagOverride(quantized=True))
    assert weights.release_idle()  # what the countdown does once no float request holds them
    held, alone = _bytes(i8), _bytes(f32)
    assert held <= alone, (held, alone)
    assert i8.weight_bytes() <= f32.weight_bytes()
    # No float copy of a weight int8 replaces: each is released or shared (a tied lm_head
    # is the embedding, which the int8 target reads too).
    params = dict(i8.target.m.named_parameters())
    kept = {p.data_ptr() for p in i8.target_q.m.parameters()}
    assert quantize.int8_encoder(i8.target_q.m)
    for name in [*quantize.step_names(i8.target.m), *quantize.encoder_names(i8.target.m)]:
        assert params[name].numel() == 0 or params[name].data_ptr() in kept, name
    assert all(params[name].numel() == 0 for name in quantize.encoder_names(i8.target.m))
    # The two targets share their bias and position tables.
    assert i8.target_q.dec_bias is i8.target.dec_bias
    # Serving int8 keeps them released.
    r = i8.generate("xabcdefx", override=FlagOverride(quantized=True))
    assert r.quantized and r.native_step and not weights.resident


def test_an_int8_engine_sharing_the_float_encoder_keeps_it(tiny_dirs: dict[str, Path]
                                                          ) -> None:
    engine = Runtime(tiny_config(tiny_dirs, quantization="int8", int8_encoder=False,
                                 use_draft=False, flags_file="", compile_mode="off"))
    try:
        weights = engine.target.weights
        assert weights is not None and weights.release_idle()
        assert engine.target_q is not None and not quantize.int8_encoder(engine.target_q.m)
        params = dict(engine.target.m.named_parameters())
        # The int8 target reads these very tensors: they stay.
        assert all(params[n].numel() > 0 for n in quantize.encoder_names(engine.target.m))
        assert engine.generate("xabcx", override=FlagOverride(quantized=True)).quantized
    finally:
        engine.close()


def test_the_float32_arm_is_a_float32_runtime_token_for_token(float32_and_int8):
    f32, i8 = float32_and_int8
    weights = i8.target.weights
    assert weights is not None
    weights.release_idle()
    reloads = weights.reloads
    texts = random_texts(8, seed=11, overflow=False)
    for text in texts:
        arm = i8.generate(text, override=FLOAT32)
        alone = f32.generate(text)
        assert not arm.quantized and arm.native_step and alone.native_step
        assert arm.output_ids == alone.output_ids, text
        ref = i8.generate(text, override=REFERENCE)
        assert ref.output_ids == f32.generate(text, override=REFERENCE).output_ids
    # Reloaded once for the whole run of float requests, then released when idle.
    assert weights.reloads == reloads + 1
    assert weights.release_idle() and _bytes(i8) <= _bytes(f32)
    # The compiled step (native_step off) reads the reloaded weights too.
    off = FlagOverride(quantized=False, native_step=False)
    arm = i8.generate(texts[0], override=off)
    alone = f32.generate(texts[0], override=FlagOverride(native_step=False))
    assert not arm.native_step and arm.output_ids == alone.output_ids
    assert weights.reloads == reloads + 2


def test_the_c_step_refuses_released_weights(float32_and_int8):
    _f32, i8 = float32_and_int8
    weights = i8.target.weights
    assert weights is not None and weights.release_idle()
    runner, m = i8.target, i8.target.m
    cross = torch.zeros((len(m.dec_layers), 2, m.n_heads, 4, m.d_kv))
    mask = m.mask_bias(torch.ones((1, 4), dtype=torch.long))
    with pytest.raises(EngineError, match="released"):
        runner.native.verify(m, torch.tensor([[0]]), torch.tensor([0]),
                             m.new_self_cache(runner.slots, static=False), cross, mask,
                             runner.bias_for(1))


def test_a_checkpoint_changed_on_disk_is_not_reloaded_as_the_float32_arm(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = shutil.copytree(tiny_dirs["target"], tmp_path / "target")
    dirs = {**tiny_dirs, "target": model}
    engine = Runtime(tiny_config(dirs, quantization="int8", use_draft=False, flags_file="",
                                 compile_mode="off"))
    try:
        weights = engine.target.weights
        assert weights is not None and weights.release_idle()
        st = (model / "model.safetensors").stat()
        os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(ModelLoadError, match="changed on disk"):
            engine.generate("xabcx", override=FLOAT32)
        assert not weights.resident
        assert engine.generate("xabcx", override=FlagOverride(quantized=True)).quantized
    finally:
        engine.close()


def test_int8_serving_warms_the_float_target_on_its_first_float_request(
        float32_and_int8, tiny_dirs: dict[str, Path],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    f32, _i8 = float32_and_int8
    engine = _runtime(tiny_dirs, tmp_path_factory.mktemp("int8-deferred-cache"), "int8")
    try:
        target, compiles = engine.target, engine.compile_snapshot()
        assert engine.models.deferred is target
        # Warm-up compiled the int8 target's functions only: no float graph is resident.
        assert engine.warmup_status().done and engine.target_q is not None
        assert engine.target_q.compiled_keys() and not target.compiled_keys()
        text = random_texts(1, seed=5, overflow=False)[0]
        r = engine.generate(text, override=FlagOverride(quantized=True))
        assert r.quantized and r.path == PATH_COMPILED and not target.compiled_keys()
        # The first float request warms it before decoding, compiled, token for token.
        arm = engine.generate(text, override=FLOAT32)
        assert not arm.quantized and arm.path == PATH_COMPILED and arm.native_step
        assert target.compiled_keys()
        assert arm.output_ids == f32.generate(text).output_ids
        assert engine.compile_snapshot().diff(compiles).compile_failures == 0
    finally:
        engine.close()
