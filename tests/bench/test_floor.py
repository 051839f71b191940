"""bench.floor: the dense products a request runs, the GEMM rate and the floor they make."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench.floor import Floor, Products, gemm_rate
from bench.throughput import describe_floor
from engine import t5


def _lean(**changes: Any) -> t5.LeanT5:
    from transformers import T5Config, T5ForConditionalGeneration

    kwargs: dict[str, Any] = dict(
        vocab_size=120, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    kwargs.update(changes)
    cfg = T5Config(**kwargs)
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(cfg).eval()
    return t5.LeanT5(cfg, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("gated", [False, True])
def test_a_request_runs_every_weight_once_per_input_token_or_decoded_position(gated):
    m = _lean(**({"feed_forward_proj": "gated-gelu"} if gated else {}))
    d, inner, vocab = 64, 4 * 16, 120
    ff = 96 * (3 if gated else 2)  # wi (two of them where gated) and wo
    # Encoder layer: q, k, v, o and the feed-forward; each decoder layer's cross K and V
    # projection runs once per input token too.
    per_token = 3 * (4 * d * inner + ff * d) + 2 * (2 * d * inner)
    # Decoder layer: self q, k, v, o, cross q and o, the feed-forward; then the LM head.
    per_position = 2 * (4 * d * inner + 2 * d * inner + ff * d) + vocab * d
    products = Products.of(m)
    assert sum(o * i for o, i in products.encoder) == per_token
    assert sum(o * i for o, i in products.decoder) == per_position
    assert products.flops(10, 7) == 2 * (per_token * 10 + per_position * 7)


def test_the_floor_is_the_rate_over_the_mean_flops_a_request():
    products = Products(encoder=((4, 2),), decoder=((3, 1),))  # 8 and 3 multiply-adds
    floor = Floor.of(products, [(1, 0), (2, 4)], rate=100.0)  # 16 and 56 flops
    assert floor.flops_per_request == 36.0
    assert floor.requests_per_s == pytest.approx(100.0 / 36.0)
    assert floor.share(floor.requests_per_s / 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="requests"):
        Floor.of(products, [], rate=100.0)


def test_the_gemm_rate_is_the_best_row_counts_flops_over_its_median_pass():
    products = Products(encoder=((8, 4),), decoder=((2, 4),))  # 40 multiply-adds a row
    ticks = iter(range(1000))
    # One tick a clock read: every timed pass takes 1 s, so the rate is a pass's flops.
    rate = gemm_rate(products, rows=(1, 3), rounds=2, clock=lambda: float(next(ticks)))
    assert rate == 2 * 3 * 40


def test_the_floor_lines_give_shares_and_the_targets_as_multiples_of_it():
    floor = Floor(flops_per_request=1e9, rate=50e9)  # 50 requests/s
    text = describe_floor(floor, {32: 30.0, 1: 20.0, 8: 25.0}, {32: 28.0})
    assert "1.000 GFLOP a request" in text and "50.0 GFLOP/s" in text
    assert "at most 50.0 requests/s" in text
    assert "batched at 1 / 8 / 32 callers: 0.40 / 0.50 / 0.60 of it" in text
    assert "3x the one-caller rate is 1.20x it" in text
    assert "2x CTranslate2 float32 at batch 32 is 1.12x it" in text
    assert "CTranslate2" not in describe_floor(floor, {1: 20.0}, {})
