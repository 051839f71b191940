"""The arithmetic floor of a workload: the requests per second a core could serve if it did
nothing but the model's dense products, at the rate its own GEMM reaches on them.

Every request of a T5 runs each encoder weight (and the decoder's cross K/V projection)
once per input token and each decoder weight (and the LM head) once per decoded position,
whatever the engine: batching shares reading the weights, not the multiply-adds. So with
F flops a request and a core that multiplies at R flop/s, no schedule serves more than
R / F requests a second. The count leaves out attention, norms and padding (an input at
its own length, not its bucket's), and R is the best of torch.mm (float32) on the model's
weight shapes, so the floor is an upper bound on throughput that no engine of this model
reaches on that core in float32: a target past it is out of reach by arithmetic, not by
scheduling. int8 has no such reference here: its products' rate is its kernel's (torch's
own int8 GEMM is a slow fallback on a CPU without VNNI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Input rows the GEMM rate is measured at: a batched step's and a long input's encoder.
RATE_ROWS = (64, 256)


def _out_in(w: Any) -> tuple[int, int]:
    """Return a float linear weight's [out, in]."""
    return int(w.shape[0]), int(w.shape[1])


@dataclass(frozen=True)
class Products:
    """The dense products of a model, as [out, in] weight shapes: those an input token runs
    (the encoder's, and the decoder's cross K/V projection of the encoder output) and those
    a decoded position runs (the decoder's other weights and the LM head)."""

    encoder: tuple[tuple[int, int], ...]
    decoder: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, lean: Any) -> Products:
        """Return the products of an engine.t5.LeanT5 with float weights."""
        enc = [_out_in(getattr(layer, name)) for layer in lean.enc_layers
               for name in ("qkv", "o", "wi", "wo")]
        enc += [_out_in(layer.ckv) for layer in lean.dec_layers]
        dec = [_out_in(getattr(layer, name)) for layer in lean.dec_layers
               for name in ("qkv", "o", "cq", "co", "wi", "wo")]
        dec.append(_out_in(lean.lm_head))
        return cls(tuple(enc), tuple(dec))

    def flops(self, input_tokens: int, positions: int) -> float:
        """Return the flops of one request: 2 per weight per input token or position."""
        per_token = sum(o * i for o, i in self.encoder)
        per_position = sum(o * i for o, i in self.decoder)
        return 2.0 * (per_token * input_tokens + per_position * positions)


def gemm_rate(products: Products, *, rows: Sequence[int] = RATE_ROWS, rounds: int = 5,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Return the best float32 flop/s torch.mm reaches on every weight shape of `products`
    (each shape once, as a request meets them) over `rows` input rows: the median of
    `rounds` passes at each row count, the best row count's."""
    import torch

    from engine.encoder_int8 import median_pass_s

    shapes = [*products.encoder, *products.decoder]
    best = 0.0
    for n in rows:
        pairs = [(torch.randn(n, i), torch.randn(i, o)) for o, i in shapes]
        flops = 2.0 * n * sum(o * i for o, i in shapes)
        best = max(best, flops / median_pass_s(pairs, torch.mm, rounds=rounds, clock=clock))
    return best


@dataclass(frozen=True)
class Floor:
    """A workload's mean flops a request and the core's GEMM rate on them."""

    flops_per_request: float
    rate: float  # flop/s

    @property
    def requests_per_s(self) -> float:
        return self.rate / self.flops_per_request

    @classmethod
    def of(cls, products: Products, requests: Sequence[tuple[int, int]], rate: float
           ) -> Floor:
        """Return the floor of `requests` ((input tokens, decoded positions) each) at `rate`."""
        if not requests:
            raise ValueError("requests: at least one request is needed")
        total = sum(products.flops(tokens, positions) for tokens, positions in requests)
        return cls(total / len(requests), rate)

    def share(self, requests_per_s: float) -> float:
        """Return a measured throughput as a share of the floor."""
        return requests_per_s / self.requests_per_s
