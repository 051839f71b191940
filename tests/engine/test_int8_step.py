"""int8 weights in the C decode step (engine.native, engine.quantize).

Stated tolerance, against engine.t5.decode_logits on the dequantized weights (q * scale,
float32), over every logit of the rows checked: max |diff| <= 0.06 x max |reference logit|
and the diff's L2 norm <= 0.03 x the reference's (the step also quantizes each activation
row to int8, rounding each value to 1/254 of its row's absmax; the int32 sums are exact);
the K/V written within 0.1.
A row batched gets bitwise the logits and cache writes of the same row decoded alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import native, quantize, t5
from engine.errors import BoundaryError, EngineError
from tests.engine.conftest import limit_isa

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")

# Built without AVX-512 ("avx2": the maddubs kernel, 8-float vectors) or without AVX at all
# ("sse": the portable int8 loops), on an x86 machine that has them.
SLOTS = 24
VOCAB = 300


def _lean(*, d_model: int, d_ff: int, gated: bool) -> t5.LeanT5:
    """A random float LeanT5 whose widths are no multiple of any vector width (tails)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=d_model, d_kv=d_model // 2, d_ff=d_ff,
                   num_layers=2, num_decoder_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, relative_attention_max_distance=32,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                   feed_forward_proj="gated-gelu" if gated else "relu")
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2:  # wider than HF's init: varied greedy outputs
                param.normal_(0.0, 1.0 if "shared" in name else 1.5 / param.shape[1] ** 0.5)
    return t5.LeanT5(cfg, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[t5.LeanT5, t5.LeanT5]]:
    """(int8 model, float reference of its dequantized weights) by shape."""
    out = {}
    for name, lean in (("relu", _lean(d_model=80, d_ff=136, gated=False)),
                       ("gated", _lean(d_model=72, d_ff=100, gated=True))):
        q = quantize.int8(lean)
        out[name] = (q, quantize.dequantize(q))
    return out


def _load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isa: str) -> native.NativeStep:
    limit_isa(tmp_path, monkeypatch, isa)
    lib = native.load(tmp_path / "cache")
    assert lib is not None
    return lib


def _request(m: t5.LeanT5, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cross K/V, mask bias) of a random input of `length` tokens (the last padded)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, length), generator=gen)
    mask = torch.ones((1, length), dtype=torch.long)
    mask[0, -1] = 0
    bias = m.mask_bias(mask)
    with torch.no_grad():
        return t5.encode(m, ids, bias, m.encoder_bias(length)), bias


def _within(got: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (got - ref).abs().max().item()
    top = ref.abs().max().item()
    assert diff <= 0.06 * top, (diff, top)
    assert (got - ref).norm().item() <= 0.03 * ref.norm().item()


@pytest.mark.parametrize("isa", ["native", "avx2", "sse"])
@pytest.mark.parametrize("shape", ["relu", "gated"])
def test_int8_step_is_within_tolerance_of_the_dequantized_float_reference(
        tmp_path, monkeypatch, models, isa, shape):
    q, ref_m = models[shape]
    assert native.applicable(q) is None
    step = _load(tmp_path, monkeypatch, isa).bind(q)
    dec_bias = q.decoder_bias(SLOTS + 1)
    # Three requests of different lengths at different positions, their caches filled.
    rows = [(*_request(ref_m, n, seed), pos, tok)
            for seed, (n, pos, tok) in enumerate([(7, 0, 0), (12, 5, 17), (3, 9, 250)])]
    gen = torch.Generator().manual_seed(9)
    caches = [torch.randn(q.new_self_cache(SLOTS, static=False).shape, generator=gen)
              for _ in rows]
    ref_caches = [c.clone() for c in caches]
    alone_caches = [c.clone() for c in caches]
    tokens = torch.tensor([r[3] for r in rows])
    positions = torch.tensor([r[2] for r in rows])
    logits = torch.zeros(len(rows), step.vocab)
    with torch.no_grad():
        out = step.rows(q, tokens, positions, caches, [r[0] for r in rows],
                        [r[1] for r in rows], dec_bias, logits=logits)
        for i, (cross, mask, pos, tok) in enumerate(rows):
            ref = t5.decode_logits(ref_m, torch.tensor([[tok]]), torch.tensor([pos]),
                                   ref_caches[i], cross, mask, dec_bias)[0, 0]
            _within(logits[i], ref)
            assert int(out[i]) == int(logits[i].argmax())
            # The same row alone: the single-row step (tw_chain) and a one-row batch.
            alone = step(q, torch.tensor([[tok]]), torch.tensor([pos]), alone_caches[i],
                         cross, mask, q.decoder_bias(SLOTS + 1)[:, :pos + 1, :pos + 1]
                         .contiguous(), 1)
            assert int(alone[0]) == int(out[i])
            one = torch.zeros(1, step.vocab)
            again = caches[i].clone()
            step.rows(q, tokens[i:i + 1], positions[i:i + 1], [again], [cross], [mask],
                      dec_bias, logits=one)
            assert torch.equal(one[0], logits[i])
    for got, alone, ref in zip(caches, alone_caches, ref_caches, strict=True):
        assert torch.equal(got, alone)  # batched writes what alone writes, bit for bit
        torch.testing.assert_close(got, ref, rtol=0, atol=0.1)


def test_speculative_verification_rows_equal_single_steps(tmp_path, monkeypatch, models):
    q, ref_m = models["relu"]
    step = _load(tmp_path, monkeypatch, "native").bind(q)
    cross, mask = _request(ref_m, 9, 4)
    bias = q.decoder_bias(SLOTS + 1)
    verified, single = (q.new_self_cache(SLOTS, static=False) for _ in range(2))
    toks = torch.tensor([[5, 9, 33, 2]])
    with torch.no_grad():
        got = step.verify(q, toks, torch.arange(3, 7), verified, cross, mask, bias)
        alone = [int(step(q, toks[:, i:i + 1], torch.tensor([3 + i]), single, cross, mask,
                          bias, 1)[0]) for i in range(4)]
    assert got.tolist() == alone and torch.equal(verified, single)


def _broken(q: t5.LeanT5, case: str) -> tuple[t5.LeanT5, str]:
    """Return a copy of int8 model `q` with one tensor broken, and the name the error gives."""
    from torch import nn

    bad = quantize._shared_copy(q)  # the copy's modules are its own: q is untouched
    layer, head = bad.dec_layers[1], bad.lm_head

    def put(module: nn.Module, attr: str, t: torch.Tensor) -> None:
        setattr(module, attr, nn.Parameter(t, requires_grad=False))

    if case == "q float":
        put(layer.wi, "q", layer.wi.q.float())
        return bad, "dec_layers[1].wi.q"
    if case == "q of another shape":
        put(layer.co, "q", layer.co.q[:, :-1].contiguous())
        return bad, "dec_layers[1].co.q"
    if case == "q not contiguous":
        put(head, "q", head.q.t().contiguous().t())
        return bad, "lm_head.q"
    if case == "scale float64":
        put(layer.qkv, "scale", layer.qkv.scale.double())
        return bad, "dec_layers[1].qkv.scale"
    if case == "scale one short":
        put(layer.wo, "scale", layer.wo.scale[:-1].contiguous())
        return bad, "dec_layers[1].wo.scale"
    if case == "scale not contiguous":
        put(head, "scale", torch.stack([head.scale, head.scale], 1)[:, 0])
        return bad, "lm_head.scale"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["q float", "q of another shape", "q not contiguous",
                                  "scale float64", "scale one short", "scale not contiguous"])
def test_a_bad_int8_tensor_is_named_before_c_reads_it(tmp_path, monkeypatch, models, case):
    q, _ref = models["relu"]
    bad, name = _broken(q, case)
    lib = _load(tmp_path, monkeypatch, "native")
    with pytest.raises(BoundaryError) as err:
        lib.bind(bad)
    assert err.value.tensor == name and isinstance(err.value, EngineError)
    assert name in str(err.value)


@pytest.mark.parametrize("isa", ["native", "sse"])
def test_nothing_is_written_past_the_buffers(tmp_path, monkeypatch, models, isa):
    q, ref_m = models["gated"]
    step = _load(tmp_path, monkeypatch, isa).bind(q)
    dec_bias = q.decoder_bias(SLOTS + 1)
    lengths = (5, 11)
    reqs = [_request(ref_m, n, n) for n in lengths]
    guard = 4096
    shape = q.new_self_cache(SLOTS, static=False).shape
    n = int(torch.Size(shape).numel())
    # Each cache a contiguous window of a larger buffer; the logits too; and the scratch
    # exactly the size the step asks for, guarded after.
    bufs = [torch.full((n + 2 * guard,), float("nan")) for _ in lengths]
    for buf in bufs:
        buf[guard:guard + n] = 0.0
    caches = [buf[guard:guard + n].view(shape) for buf in bufs]
    out_buf = torch.full((2 * step.vocab + 2 * guard,), float("nan"))
    logits = out_buf[guard:guard + 2 * step.vocab].view(2, step.vocab)
    need = step.scratch_floats(2, max(dec_bias.shape[-1], max(lengths)))
    scratch = torch.full((need + guard,), 7.0)
    step._local.buf = scratch
    with torch.no_grad():
        step.rows(q, torch.tensor([4, 8]), torch.tensor([2, 6]), caches,
                  [r[0] for r in reqs], [r[1] for r in reqs], dec_bias, logits=logits)
    assert step._local.buf is scratch  # large enough: used as is
    assert bool((scratch[need:] == 7.0).all())
    for buf, cache, pos in zip(bufs, caches, (2, 6), strict=True):
        assert bool(buf[:guard].isnan().all()) and bool(buf[guard + n:].isnan().all())
        written = cache.abs().sum(dim=(0, 1, 2, 4)) > 0
        assert written.nonzero().flatten().tolist() == [pos]  # only the row's own slot
    assert bool(out_buf[:guard].isnan().all()) and bool(out_buf[-guard:].isnan().all())
    assert not bool(logits.isnan().any())


def test_batched_rows_honour_the_native_step_override_and_flag(tmp_path, tiny_dirs):
    """The batching loop decodes a row with the C step only while the request's native_step
    (override, else the instance's flag) is on, on the float and the int8 target alike."""
    from engine.protocol import FlagOverride, InMemoryFlagProvider, RuntimeFlags
    from engine.runtime import Runtime
    from tests.engine.conftest import random_texts, tiny_config

    flags = InMemoryFlagProvider()
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager", use_draft=False, max_batch=2,
                             quantization="int8", cache_dir=str(tmp_path / "cache")), flags)
    try:
        rt.warm_up(background=False)
        assert rt.step_kind == "target native, target-int8 native"
        calls = {"target": 0, "target-int8": 0}
        for runner in (rt.target, rt.target_q):
            assert runner is not None and runner.native is not None
            # The loop's C calls, counted: over rows, and a lone row's on its own caches.
            for entry in ("rows", "verify"):
                real = getattr(runner.native, entry)

                def counting(*args, _real=real, _name=runner.name, **kwargs):
                    calls[_name] += 1
                    return _real(*args, **kwargs)

                setattr(runner.native, entry, counting)
        texts = random_texts(3, seed=5, overflow=False)
        for quantized, name in ((False, "target"), (True, "target-int8")):
            on = [rt.generate(t, max_new_tokens=6, override=FlagOverride(quantized=quantized))
                  for t in texts]
            assert calls[name] > 0
            assert all(r.native_step and r.quantized == quantized and r.path == "compiled"
                       for r in on)
            before = dict(calls)
            off = [rt.generate(t, max_new_tokens=6,
                               override=FlagOverride(quantized=quantized, native_step=False))
                   for t in texts]
            flags.set(RuntimeFlags(native_step=False))  # the policy's per-instance fallback
            fell_back = rt.generate(texts[0], max_new_tokens=6,
                                    override=FlagOverride(quantized=quantized))
            flags.set(RuntimeFlags())
            assert calls == before  # no row of these went through C
            assert not any(r.native_step for r in [*off, fell_back])
            assert all(r.quantized == quantized for r in [*off, fell_back])
            if not quantized:  # float32: the compiled step's tokens are the C step's
                assert [r.output_ids for r in off] == [r.output_ids for r in on]
                assert fell_back.output_ids == on[0].output_ids
    finally:
        rt.close()


@pytest.mark.parametrize(("case", "name"), [("weight float64", "dec_layers[0].o"),
                                            ("embedding short of the vocabulary", "embed")])
def test_a_bad_float_weight_is_named_too(tmp_path, monkeypatch, models, case, name):
    from torch import nn

    _q, ref_m = models["relu"]  # a float model (the dequantized weights)
    bad = quantize._shared_copy(ref_m)
    if case == "weight float64":
        bad.dec_layers[0].o = nn.Parameter(bad.dec_layers[0].o.double(), requires_grad=False)
    else:
        bad.embed = nn.Parameter(bad.embed[:-1].contiguous(), requires_grad=False)
    lib = _load(tmp_path, monkeypatch, "native")
    with pytest.raises(BoundaryError) as err:
        lib.bind(bad)
    assert err.value.tensor == name


def _c_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Int8Weight.linear compute what the C step computes: each input row quantized to
    int8 (its absmax / 127, rounded to nearest even), the int8 products summed exactly, and
    scaled back as S[r] * (row scale * sum), all in float32 where C is."""

    def linear(self: quantize.Int8Weight, x: torch.Tensor) -> torch.Tensor:
        top = x.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
        xq = torch.round(x * inv)
        sums = (xq.double() @ self.q.double().T).float()  # int32 sums, exact in float64
        return self.scale * ((top / 127.0) * sums)

    monkeypatch.setattr(quantize.Int8Weight, "linear", linear)


def _odd_widths(seed: int) -> t5.LeanT5:
    """Return a random int8 LeanT5 of 3 x 78, 134 and 301 rows and 78 and 134 inputs."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=301, d_model=78, d_kv=39, d_ff=134, num_layers=1,
                   num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, feed_forward_proj="relu")
    torch.manual_seed(seed)
    hf = T5ForConditionalGeneration(cfg).eval()
    return quantize.int8(t5.LeanT5(cfg, hf.state_dict(), dtype=torch.float32,
                                   device=torch.device("cpu")))


@pytest.mark.parametrize("isa", ["native", "avx2", "sse"])
def test_int8_products_at_widths_past_every_block_are_the_int8_arithmetic(
        tmp_path, monkeypatch, isa):
    # Rows that leave some past the last block of four (3 x 78, 134, 301) and inputs that
    # end in a partial chunk of every vector width (78, 134): a product that dropped, or
    # doubled, a row or a chunk would be off by far more than float rounding.
    q = _odd_widths(1)
    step = _load(tmp_path, monkeypatch, isa).bind(q)
    _c_arithmetic(monkeypatch)  # after binding: the torch reference below uses it
    dec_bias = q.decoder_bias(SLOTS + 1)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for seed, (n, pos) in enumerate([(9, 0), (14, 6), (5, 11)]):
        ids = torch.randint(2, 301, (1, n), generator=gen)
        mask = torch.ones((1, n), dtype=torch.long)
        bias = q.mask_bias(mask)
        with torch.no_grad():
            cross = t5.encode(q, ids, bias, q.encoder_bias(n))
        rows.append((cross, bias, pos, 7 + 40 * seed))
    caches = [torch.randn(q.new_self_cache(SLOTS, static=False).shape, generator=gen)
              for _ in rows]
    ref_caches = [c.clone() for c in caches]
    logits = torch.zeros(len(rows), step.vocab)
    with torch.no_grad():
        step.rows(q, torch.tensor([r[3] for r in rows]), torch.tensor([r[2] for r in rows]),
                  caches, [r[0] for r in rows], [r[1] for r in rows], dec_bias, logits=logits)
        for i, (cross, mask, pos, tok) in enumerate(rows):
            ref = t5.decode_logits(q, torch.tensor([[tok]]), torch.tensor([pos]),
                                   ref_caches[i], cross, mask, dec_bias)[0, 0]
            # Float rounding apart (sums in another order, a rounding of an activation
            # flipped by it now and then): the same numbers.
            assert (logits[i] - ref).abs().max().item() <= 2e-3 * ref.abs().max().item()
    for got, ref in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["native", "vectors", "avx2", "sse"])
def test_a_full_batch_at_odd_widths_is_each_row_alone_bit_for_bit(tmp_path, monkeypatch, isa):
    # 83 rows: with AVX-512 VNNI, 4 inputs and more take the weights repacked at bind
    # (sixteen rows a vector; 3 x 78, 134 and 301 rows leave a partial block, 78 and 134
    # inputs a partial group of four bytes); with AMX they go through the tiles (64
    # inputs, then 16, then the last 3 in a padded block), in the "vectors" build through
    # the vector registers; one row alone takes the four-row blocks. All sum exactly in
    # int32: the same bits.
    q = _odd_widths(2)
    step = _load(tmp_path, monkeypatch, isa).bind(q)
    dec_bias = q.decoder_bias(SLOTS + 1)
    gen = torch.Generator().manual_seed(5)
    n = 83
    crosses, masks = [], []
    for i in range(n):
        length = 3 + i % 11
        ids = torch.randint(2, 301, (1, length), generator=gen)
        mask = q.mask_bias(torch.ones((1, length), dtype=torch.long))
        with torch.no_grad():
            crosses.append(t5.encode(q, ids, mask, q.encoder_bias(length)))
        masks.append(mask)
    caches = [torch.randn(q.new_self_cache(SLOTS, static=False).shape, generator=gen)
              for _ in range(n)]
    alone_caches = [c.clone() for c in caches]
    tokens = torch.randint(2, 301, (n,), generator=gen)
    positions = torch.tensor([i % SLOTS for i in range(n)])
    logits = torch.zeros(n, step.vocab)
    with torch.no_grad():
        step.rows(q, tokens, positions, caches, crosses, masks, dec_bias, logits=logits)
        for i in range(n):
            one = torch.zeros(1, step.vocab)
            step.rows(q, tokens[i:i + 1], positions[i:i + 1], [alone_caches[i]],
                      [crosses[i]], [masks[i]], dec_bias, logits=one)
            assert torch.equal(one[0], logits[i]), i
    for got, alone in zip(caches, alone_caches, strict=True):
        assert torch.equal(got, alone)
    # Not a shared mistake of both kernels: the rows are the int8 arithmetic.
    _c_arithmetic(monkeypatch)
    ref_caches = [c.clone() for c in caches]
    with torch.no_grad():
        for i in range(n):
            ref = t5.decode_logits(q, tokens[i].view(1, 1), positions[i:i + 1],
                                   ref_caches[i], crosses[i], masks[i], dec_bias)[0, 0]
            assert (logits[i] - ref).abs().max().item() <= 2e-3 * ref.abs().max().item(), i


def test_the_repacked_layout_holds_four_bytes_of_sixteen_rows_a_group():
    # engine.native.repack_int8 (made once at bind, read by the C step's repacked and tiled
    # int8 products): block b, group g, lane j holds bytes 4g .. 4g + 3 of row 16b + j;
    # rows past the weight's and bytes past its width are zero weights, groups padded to
    # whole 64-byte chunks.
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (37, 70), generator=gen, dtype=torch.int8)
    packed = native.repack_int8(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 32, 16)
    raw = packed.contiguous().view(torch.int8).view(3, 32, 16, 4)
    for b in range(3):
        for j in range(16):
            row = 16 * b + j
            got = raw[b, :, j, :].reshape(-1)
            want = torch.zeros(128, dtype=torch.int8)
            if row < 37:
                want[:70] = q[row]
            assert torch.equal(got, want), (b, j)
