"""The lean T5 forward matches Hugging Face's logits, padded or not."""

from __future__ import annotations

import pytest
import torch

from engine import t5


@pytest.fixture(scope="module")
def models(tiny_dirs):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from engine.loader import load_model

    hf = T5ForConditionalGeneration.from_pretrained(tiny_dirs["target"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dirs["target"])
    loaded = load_model(tiny_dirs["target"])
    lean = t5.LeanT5(loaded.config, loaded.weights, dtype=torch.float32,
                     device=torch.device("cpu"))
    return hf, tok, lean


@pytest.fixture(scope="module")
def eager_runner(models):
    from engine.runner import ModelRunner

    # The tiny engine's shape: 40 new tokens + 4 slots of headroom (spans 32 and 44).
    return ModelRunner(models[2], edges=(8,), slots=44, verify_q=5, options=None, name="t")


@pytest.mark.parametrize("encode", [t5.encode, t5.encode_fused])
@pytest.mark.parametrize("pad_to", [None, 32])
def test_lean_logits_match_hf(models, pad_to, encode):
    hf, tok, m = models
    ids = tok("a byte-level input", return_tensors="pt").input_ids
    n = ids.shape[1]
    length = pad_to or n
    padded = torch.zeros((1, length), dtype=torch.long)
    padded[0, :n] = ids[0]
    mask = torch.zeros((1, length), dtype=torch.long)
    mask[0, :n] = 1
    dec = torch.tensor([[0, 104, 105, 33, 40, 41]])
    with torch.no_grad():
        ref = hf(input_ids=ids, decoder_input_ids=dec).logits
        mask_bias = m.mask_bias(mask)
        cross = encode(m, padded, mask_bias, m.encoder_bias(length))
        slots = 12
        dec_bias = m.decoder_bias(slots)
        kv = m.new_self_cache(slots)
        steps = [t5.decode_logits(m, dec[:, i:i + 1], torch.tensor([i]), kv, cross,
                                  mask_bias, dec_bias) for i in range(dec.shape[1])]
        stepwise = torch.cat(steps, 1)
        block = t5.decode_logits(m, dec, torch.arange(dec.shape[1]), m.new_self_cache(slots),
                                 cross, mask_bias, dec_bias)
    assert ref.abs().max() > 0.5  # a meaningful comparison, not all zeros
    torch.testing.assert_close(stepwise, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(block, ref, atol=1e-4, rtol=1e-4)


def test_stale_cache_slots_are_masked(models):
    """Garbage in slots after the query position (a rolled-back draft) changes nothing."""
    hf, tok, m = models
    ids = tok("rollback", return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    with torch.no_grad():
        mask_bias = m.mask_bias(mask)
        cross = t5.encode(m, ids, mask_bias, m.encoder_bias(ids.shape[1]))
        dec_bias = m.decoder_bias(10)
        clean = m.new_self_cache(10)
        dirty = m.new_self_cache(10)
        dirty[:, :, :, 3:].normal_()
        tokens = torch.tensor([[0, 50, 60]])
        a = t5.decode_logits(m, tokens, torch.arange(3), clean, cross, mask_bias, dec_bias)
        b = t5.decode_logits(m, tokens, torch.arange(3), dirty, cross, mask_bias, dec_bias)
    torch.testing.assert_close(a, b)


def test_multi_token_step_equals_single_steps(models):
    """decode_steps(steps=n) gives the tokens of n single steps and the same cache."""
    hf, tok, m = models
    ids = tok("several steps per call", return_tensors="pt").input_ids
    with torch.no_grad():
        mask_bias = m.mask_bias(torch.ones_like(ids))
        cross = t5.encode(m, ids, mask_bias, m.encoder_bias(ids.shape[1]))
        dec_bias = m.decoder_bias(16)
        one, many = m.new_self_cache(16), m.new_self_cache(16)
        token, singles = torch.tensor([[0]]), []
        for i in range(6):
            token = t5.decode_steps(m, token, torch.tensor([i]), one, cross, mask_bias,
                                    dec_bias, 1).view(1, 1)
            singles.append(int(token))
        first = t5.decode_steps(m, torch.tensor([[0]]), torch.tensor([0]), many, cross,
                                mask_bias, dec_bias, 3)
        second = t5.decode_steps(m, first[-1:].view(1, 1), torch.tensor([3]), many, cross,
                                 mask_bias, dec_bias, 3)
    assert first.tolist() + second.tolist() == singles
    torch.testing.assert_close(one[:, :, :, :6], many[:, :, :, :6])


def test_step_attends_only_its_span(eager_runner):
    """Slots past the span are never read: NaN there reaches the logits only with all slots."""
    runner = eager_runner
    m = runner.m
    span = runner.bias_for(1).shape[-1]
    assert span < runner.slots  # the first step attends a short prefix, not the whole cache
    ids = torch.tensor([[40, 41, 42, 1]])
    with torch.no_grad():
        mask_bias = m.mask_bias(torch.ones_like(ids))
        cross = t5.encode(m, ids, mask_bias, m.encoder_bias(4))
        clean, poisoned = m.new_self_cache(runner.slots), m.new_self_cache(runner.slots)
        poisoned[:, :, :, span:] = float("nan")
        start, pos = runner.start, runner.positions[0]
        a = t5.decode_logits(m, start, pos, clean, cross, mask_bias, runner.bias_for(1))
        b = t5.decode_logits(m, start, pos, poisoned, cross, mask_bias, runner.bias_for(1))
        full = t5.decode_logits(m, start, pos, poisoned, cross, mask_bias, runner.dec_bias)
    torch.testing.assert_close(a, b)
    assert torch.isnan(full).all()  # the old full-cache attention did read them


def test_bias_for_covers_every_position(eager_runner):
    """Each span covers the positions it serves and is the corner of the full table."""
    runner = eager_runner
    for end in range(1, runner.slots + 1):
        bias = runner.bias_for(end)
        span = bias.shape[-1]
        assert end <= span <= runner.slots and bias.shape[1] == span
        torch.testing.assert_close(bias, runner.dec_bias[:, :span, :span])


@pytest.mark.parametrize("length", [8, 16, 32])
def test_encode_batch_rows_equal_each_input_alone(models, length):
    # Inputs of one padded length and different real lengths, encoded together: each
    # row's cross K/V is what `encode` gives that input alone.
    m = models[2]
    gen = torch.Generator().manual_seed(length)
    b = 5
    ids = torch.randint(3, m.vocab_size, (b, length), generator=gen)
    mask = torch.zeros((b, length), dtype=torch.long)
    for i, n in enumerate(torch.randint(2, length + 1, (b,), generator=gen).tolist()):
        mask[i, :n] = 1
        ids[i, n:] = m.pad_id
    mask_bias = torch.cat([m.mask_bias(mask[i:i + 1]) for i in range(b)])
    enc_bias = m.encoder_bias(length)
    with torch.no_grad():
        rows = t5.encode_batch(m, ids, mask_bias, enc_bias)
        alone = [t5.encode(m, ids[i:i + 1], mask_bias[i:i + 1], enc_bias) for i in range(b)]
    assert rows.shape == (b, *alone[0].shape)
    for i in range(b):
        torch.testing.assert_close(rows[i], alone[i], atol=1e-5, rtol=1e-5)
