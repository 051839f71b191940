"""float16: hidden states clamped as Hugging Face's T5 clamps them, so a layer whose
activations pass float16's range stays finite (and equal to HF's)."""

from __future__ import annotations

import torch

from engine import t5


def _large_activation_t5():
    """A small T5 whose first encoder feed-forward layer overflows float16 (~1e5 too large)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32, decoder_start_token_id=0, pad_token_id=0,
                   eos_token_id=1, dropout_rate=0.0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(1e5)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return cfg, model, weights


def _encode(lean, ids):
    mask = lean.mask_bias(torch.ones_like(ids))
    with torch.no_grad():
        return t5.encode(lean, ids, mask, lean.encoder_bias(ids.shape[1]))


def test_the_clamp_keeps_a_large_activation_layer_finite(monkeypatch):
    cfg, model, weights = _large_activation_t5()
    lean = t5.LeanT5(cfg, weights, dtype=torch.float16, device=torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 1]])
    cross = _encode(lean, ids)
    assert torch.isfinite(cross).all()

    # HF's float16 encoder on the same weights: the same clamped hidden states.
    with torch.no_grad():
        hidden = model.half().encoder(input_ids=ids).last_hidden_state
        assert torch.isfinite(hidden).all()
        want = torch.nn.functional.linear(hidden, lean.dec_layers[0].ckv)
    got = cross[0].permute(2, 0, 1, 3).reshape(1, ids.shape[1], -1)  # [B, 2 * H * d_kv]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

    # The decoder's logits stay finite too.
    slots = 8
    cache = lean.new_self_cache(slots, static=False)
    mask = lean.mask_bias(torch.ones_like(ids))
    with torch.no_grad():
        logits = t5.decode_logits(lean, torch.tensor([[0]]), torch.tensor([0]), cache, cross,
                                  mask, lean.decoder_bias(slots))
    assert torch.isfinite(logits).all()

    # Without the clamp the same layer overflows: inf, then NaN through the next norm.
    monkeypatch.setattr(t5, "_clamp_fp16", lambda x: x)
    assert not torch.isfinite(_encode(lean, ids)).all()


def test_other_dtypes_are_not_clamped():
    x = torch.tensor([3e38, -3e38, 1.0])
    assert t5._clamp_fp16(x) is x
    assert t5._clamp_fp16(x.bfloat16()).dtype == torch.bfloat16
    half = torch.tensor([float("inf"), 1.0, -7e4], dtype=torch.float16)
    clamped = t5._clamp_fp16(half)
    limit = torch.tensor(torch.finfo(torch.float16).max - 1000, dtype=torch.float16).item()
    assert clamped.tolist() == [limit, 1.0, -limit]


def test_a_batched_row_is_clamped_as_it_is_alone():
    """decode_rows' rows are one sequence: one row's inf must not lower another row's limit."""
    rows = torch.tensor([[[float("inf"), 1.0], [65024.0, 1.0]]], dtype=torch.float16)
    batched = t5._clamp_fp16(rows, per_row=True)
    for r in range(rows.shape[1]):
        alone = t5._clamp_fp16(rows[:, r:r + 1])
        assert batched.dtype == torch.float16 and torch.equal(batched[:, r:r + 1], alone), r
    assert batched[0, 1, 0].item() == 65024.0  # under the whole-tensor rule: max - 1000
