"""The encoder's int8 products (engine.encoder_int8, engine.quantize.int8(encoder=True)).

Stated tolerance, against float products of the dequantized weights (q * scale): every row's
L2 error within 3% of that row's reference norm, whatever the other rows' magnitudes (the
activations are quantized per call and per row to 8 bits, so an outlier channel leaves the
rest of its row few levels); the
whole encoder's cross K/V within 5% (L2) of the dequantized float encoder's on a small
random model; on the built-in target, greedy tokens of the int8 encoder and int8 C step
agree with the float32 C step's on >= 99% of the canaries' tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from engine import encoder_int8, native, quantize, t5
from engine.encoder_int8 import Int8EncoderWeight
from engine.protocol import FlagOverride
from tests.engine.conftest import random_texts, tiny_config

pytestmark = pytest.mark.skipif(not encoder_int8.available(), reason="no torch._int_mm")


def _row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_each_row_is_within_tolerance_of_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen) / 80 ** 0.5
    p = Int8EncoderWeight(w)
    deq = p.dequantized()
    # Half a quantization step per weight: the scale is the row's absmax / 127.
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    x = torch.randn(1, 12, 80, generator=gen)
    x[0, 3] *= 1e-3  # a quiet row beside loud ones: per-tensor rounding would flatten it
    x[0, 7] *= 50.0
    x[0, :, 5] *= 20.0  # an outlier channel
    got = p.linear(x)
    ref = F.linear(x, deq)
    assert got.shape == ref.shape and got.dtype == x.dtype
    errors = _row_errors(got[0], ref[0])
    assert float(errors.max()) <= 0.03, errors


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
@pytest.mark.parametrize(("out_f", "in_f"), [(96, 80), (30, 21)])
def test_any_rows_and_widths_multiply_exactly_in_int32(rows: int, out_f: int, in_f: int
                                                       ) -> None:
    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-127, 128, (rows, in_f), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (in_f, out_f), generator=gen, dtype=torch.int8)
    got = encoder_int8.int_mm(a, b)
    assert got.dtype == torch.int32 and got.shape == (rows, out_f)
    assert torch.equal(got, a.long().matmul(b.long()).to(torch.int32))
    p = Int8EncoderWeight(torch.randn(out_f, in_f, generator=gen))
    x = torch.randn(2, rows, in_f, generator=gen)
    assert p.linear(x).shape == (2, rows, out_f)


def test_int8_weights_are_parameters_of_a_quarter_of_the_float_bytes() -> None:
    p = Int8EncoderWeight(torch.randn(64, 32))
    assert p.shape == (64, 32)
    params = dict(p.named_parameters())
    assert params["q"].dtype == torch.int8 and params["q"].shape == (32, 64)
    assert sum(t.numel() * t.element_size() for t in params.values()) == 64 * 32 + 4 * 64


def test_the_int8_encoder_compiles_to_the_eager_result() -> None:
    m = _small_lean()
    q = quantize.int8(m, encoder=True)
    ids = torch.randint(2, 120, (1, 12), generator=torch.Generator().manual_seed(3))
    args = (ids, m.mask_bias(torch.ones_like(ids)), m.encoder_bias(12))
    # The compiler is not what this checks: the graph traces through the int8 product.
    compiled = torch.compile(t5.encode, backend="aot_eager", dynamic=False, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(q, *args), t5.encode(q, *args), atol=1e-5)


def _small_lean() -> t5.LeanT5:
    from transformers import T5Config, T5ForConditionalGeneration

    # Through a dict: transformers' stubs do not list T5's own keyword arguments.
    kwargs: dict[str, Any] = dict(
        vocab_size=120, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg = T5Config(**kwargs)
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(cfg).eval()
    return t5.LeanT5(cfg, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))


def test_the_int8_encoder_is_within_tolerance_and_shares_the_float_rest() -> None:
    m = _small_lean()
    q = quantize.int8(m, encoder=True)
    assert quantize.int8_encoder(q) and not quantize.int8_encoder(quantize.int8(m))
    assert not quantize.shares_encoder(m, q)
    # The float model is untouched; what the int8 copy does not replace is the same tensor.
    assert isinstance(m.enc_layers[0].qkv, torch.Tensor)
    assert q.embed is m.embed and q.enc_layers[0].ln_att is m.enc_layers[0].ln_att
    packed = [getattr(layer, n) for layer in q.enc_layers for n in encoder_int8.ENCODER_WEIGHTS]
    packed += [layer.ckv for layer in q.dec_layers]
    assert all(encoder_int8.is_int8_encoder_weight(w) for w in packed)
    assert (quantize.weight_bytes(q, beyond=m)
            == quantize.weight_bytes(quantize.int8(m), beyond=m)
            + sum(w.q.numel() + 4 * w.scale.numel() for w in packed))
    ids = torch.randint(2, 120, (1, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    bias = m.mask_bias(mask)
    with torch.no_grad():
        got = t5.encode(q, ids, bias, m.encoder_bias(9))
        ref = t5.encode(quantize.dequantize(q), ids, bias, m.encoder_bias(9))
    assert got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) <= 0.05


def _greedy(lib: native.NativeStep, m: t5.LeanT5, ids: torch.Tensor, new: int) -> list[int]:
    from bench.quality import small_decode

    out = small_decode(lib.bind(m), m, ids, new)
    return out[:out.index(m.eos_id) + 1] if m.eos_id in out else out


@pytest.mark.slow
@pytest.mark.skipif(native._compiler() is None, reason="no C compiler")
def test_the_builtin_targets_int8_encoder_keeps_agreement(tmp_path: Path) -> None:
    from bench.engine import _canaries
    from engine import loader
    from engine.config import BUILTIN_DIR
    from probes.quality import compare

    loaded = loader.load_model(BUILTIN_DIR / "target")
    assert loaded.weights is not None
    m = t5.LeanT5(loaded.config, loaded.weights, dtype=torch.float32,
                  device=torch.device("cpu"))
    q = quantize.int8(m, encoder=True)
    lib = native.load(tmp_path / "cache")
    assert lib is not None
    agreements = []
    for domain in ("in_domain", "shifted"):
        for text in _canaries(domain)[:6]:
            ids = torch.tensor([loaded.tokenizer(text).input_ids])
            ref = _greedy(lib, m, ids, 32)
            agreements.append(compare(_greedy(lib, q, ids, 32), ref).agreement)
    assert sum(agreements) / len(agreements) >= 0.99, agreements


def test_int8_encoder_is_on_with_int8_and_changes_the_artifact(
        tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="int8_encoder: needs quantization int8"):
        tiny_config(tiny_dirs, int8_encoder=True)
    assert not tiny_config(tiny_dirs).int8_encoder_on
    default = tiny_config(tiny_dirs, quantization="int8")
    on = tiny_config(tiny_dirs, quantization="int8", int8_encoder=True)
    off = tiny_config(tiny_dirs, quantization="int8", int8_encoder=False)
    assert default.int8_encoder_on and on.int8_encoder_on and not off.int8_encoder_on
    assert default.config_hash() == on.config_hash() != off.config_hash()


@pytest.mark.slow
def test_the_runtime_serves_int8_requests_through_the_int8_encoder(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from engine.memory import held_tensors
    from engine.protocol import REFERENCE
    from engine.runtime import Runtime

    engine = Runtime(tiny_config(tiny_dirs, quantization="int8", int8_encoder=True,
                                 use_draft=False, flags_file="",
                                 cache_dir=str(tmp_path / "cache")))
    try:
        engine.warm_up(background=False)
        target, target_q = engine.target, engine.target_q
        assert target_q is not None and quantize.int8_encoder(target_q.m)
        # Its own encoder, compiled; the float target's encoder keeps its float weights and
        # its compiled graph.
        assert target_q.encoder_of is None and target_q.compile_encoder
        assert not quantize.int8_encoder(target.m) and target.compile_encoder
        assert isinstance(target.m.enc_layers[0].qkv, torch.Tensor)
        held = held_tensors(engine.models.runners())
        qt = target_q.m.enc_layers[0].qkv.q
        assert held["target-int8.enc_layers.0.qkv.q"] == qt.numel() > 0
        for text in random_texts(4, seed=5, overflow=False):
            r = engine.generate(text, override=FlagOverride(quantized=True))
            assert r.quantized and r.output_ids
            f32 = engine.generate(text, override=FlagOverride(quantized=False))
            ref = engine.generate(text, override=REFERENCE)
            assert not f32.quantized and not ref.quantized and ref.path == "eager"
    finally:
        engine.close()


@pytest.mark.parametrize("gated", [False, True])
def test_the_measured_shapes_are_the_products_the_int8_encoder_multiplies(gated) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    kwargs: dict[str, Any] = dict(
        vocab_size=120, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        feed_forward_proj="gated-gelu" if gated else "relu")
    cfg = T5Config(**kwargs)
    lean = t5.LeanT5(cfg, T5ForConditionalGeneration(cfg).state_dict(), dtype=torch.float32,
                     device=torch.device("cpu"))
    packed = quantize.int8(lean, encoder=True)
    multiplied = [getattr(layer, name).shape for layer in packed.enc_layers
                  for name in encoder_int8.ENCODER_WEIGHTS]
    multiplied += [layer.ckv.shape for layer in packed.dec_layers]
    assert encoder_int8.shapes(cfg) == multiplied


def test_the_int8_encoder_is_kept_unless_its_products_are_past_the_limit() -> None:
    limit = encoder_int8.SLOWER_LIMIT
    assert encoder_int8.ProductTimes(32, 0.5, 1.0).int8_pays
    assert encoder_int8.ProductTimes(32, limit, 1.0).int8_pays
    assert not encoder_int8.ProductTimes(32, limit * 1.01, 1.0).int8_pays


def test_the_products_are_timed_as_the_median_of_passes_after_a_warm_one() -> None:
    reads = iter(range(1000))
    # Each clock read one tick on: every timed pass takes 1 s, the warm one is not counted.
    times = encoder_int8.time_products([(8, 4), (4, 8)], rows=3, rounds=2,
                                       clock=lambda: float(next(reads)))
    assert (times.rows, times.int8_s, times.float_s) == (3, 1.0, 1.0)
    # Two kinds a round: one read in the warm pass, two in each of the 2 timed ones.
    assert next(reads) == 2 * (1 + 2 * 2)


@pytest.mark.parametrize(("int8_s", "on"), [(10.0, False), (0.5, True)])
def test_an_unset_int8_encoder_follows_the_products_measured_at_start(
        tiny_dirs: dict[str, Path], tmp_path: Path, monkeypatch, int8_s, on) -> None:
    from engine.runtime import Runtime

    measured = []

    def timed(shapes, **_kwargs):
        measured.append(shapes)
        return encoder_int8.ProductTimes(32, int8_s, 1.0)

    monkeypatch.setattr(encoder_int8, "time_products", timed)
    config = tiny_config(tiny_dirs, quantization="int8", use_draft=False, flags_file="",
                         compile_mode="off", cache_dir=str(tmp_path / "cache"))
    engine = Runtime(config)
    try:
        assert len(measured) == 1 and engine.config.int8_encoder is on
        assert engine.target_q is not None and quantize.int8_encoder(engine.target_q.m) is on
        # Without its own: the int8 target calls the float target's encoder.
        assert (engine.target_q.encoder_of is engine.target) is not on
        # The saved packages and the cohort follow the encoder that serves.
        decided = dataclasses.replace(config, int8_encoder=on)
        assert engine.info.config_hash == decided.config_hash()
        assert engine.generate("xabcx", override=FlagOverride(quantized=True)).quantized
    finally:
        engine.close()


def test_a_set_int8_encoder_or_float32_serving_measures_nothing(
        tiny_dirs: dict[str, Path], monkeypatch) -> None:
    from engine.models import resolve_int8_encoder

    def timed(*_args, **_kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(encoder_int8, "time_products", timed)
    cpu = torch.device("cpu")
    for config in (tiny_config(tiny_dirs, quantization="int8", int8_encoder=False),
                   tiny_config(tiny_dirs, quantization="int8", int8_encoder=True),
                   tiny_config(tiny_dirs)):
        assert resolve_int8_encoder(config, cpu) is config
    # CUDA: on, as before it was measured on a CPU; without torch._int_mm: off.
    unset = tiny_config(tiny_dirs, quantization="int8")
    assert resolve_int8_encoder(unset, torch.device("cuda")).int8_encoder is True
    monkeypatch.setattr(encoder_int8, "available", lambda: False)
    assert resolve_int8_encoder(unset, cpu).int8_encoder is False
