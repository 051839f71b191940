"""int8 weights for the encoder's multi-row products (engine.quantization: int8).

The decoder step's int8 weights are read by the C step (engine.native), one row of
activations at a time. The encoder multiplies every input token at once: there each
product is an int8 x int8 matrix product with int32 sums (`torch._int_mm`, oneDNN's s8s8
GEMM on the CPU), its activations quantized per call and per row (absmax / 127, 8 bits,
as the C step rounds them) and the sums scaled back by the row's scale and the weight's
per-output-channel scale (docs/engine.md#the-int8-encoder).

`Int8EncoderWeight` holds plain tensors (the int8 weight, transposed once into the
[in, out] layout the product reads, and the float scales), so the encoder stays one
compiled graph (the quantize, product and rescale fused around the GEMM call) and the
saved AOTInductor package carries the int8 bytes; they count as parameters wherever
weights are counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Encoder products the int8 target multiplies in int8 (the decoder's cross K/V projection
# runs in the encoder too); engine.quantize decides per model whether they are used.
ENCODER_WEIGHTS = ("qkv", "o", "wi", "wo")

# CUDA's int8 GEMM takes more than 16 rows, and inner and output widths in multiples of 8.
CUDA_MIN_ROWS = 17
CUDA_MULTIPLE = 8


# engine.int8_encoder unset: at start, the encoder's products are timed at the rows of a
# typical input, int8 x int8 against float32 (a warm pass, then PROBE_ROUNDS, each shape
# once a pass), and the int8 encoder is kept unless its products take more than
# SLOWER_LIMIT times float32's. Not 1: the compiled int8 encoder gains beyond its products
# (the quantize and rescale fuse around them; docs/engine.md#the-int8-encoder), so products
# a little slower do not make it slower. Where torch's int8 GEMM is a fallback (a CPU
# without VNNI) its products take an order of magnitude longer, and so does every request.
PROBE_ROWS = 32
PROBE_ROUNDS = 3
SLOWER_LIMIT = 2.0


def shapes(config: Any) -> list[tuple[int, int]]:
    """Return the [out, in] of every product an int8 encoder multiplies in int8, from a
    T5 config: each encoder layer's q/k/v, o, feed-forward in and out, and each decoder
    layer's cross K/V projection (ENCODER_WEIGHTS)."""
    d, inner = config.d_model, config.d_kv * config.num_heads
    wi = config.d_ff * (2 if getattr(config, "is_gated_act", False) else 1)
    layer = [(3 * inner, d), (d, inner), (wi, d), (d, config.d_ff)]
    return layer * config.num_layers + [(2 * inner, d)] * config.num_decoder_layers


@dataclass(frozen=True)
class ProductTimes:
    """The median seconds of one pass over the encoder's products at `rows` rows."""

    rows: int
    int8_s: float
    float_s: float

    @property
    def int8_pays(self) -> bool:
        """Return whether the int8 encoder is kept (SLOWER_LIMIT)."""
        return self.int8_s <= SLOWER_LIMIT * self.float_s

    def describe(self) -> str:
        """Return the two times as the start's log line says them."""
        return (f"its int8 x int8 products took {self.int8_s * 1e3:.2f} ms a pass against "
                f"float32's {self.float_s * 1e3:.2f} ms at {self.rows} rows")


def median_pass_s(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  mm: Callable[[torch.Tensor, torch.Tensor], Any], *, rounds: int,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """Return the median seconds of `rounds` passes of `mm` over `pairs`, after one warm
    pass (it warms the library's paths and the caches)."""
    times = []
    with torch.no_grad():
        for round_ in range(rounds + 1):
            start = clock()
            for a, b in pairs:
                mm(a, b)
            if round_:
                times.append(clock() - start)
    return statistics.median(times)


def time_products(product_shapes: Sequence[tuple[int, int]], *, rows: int = PROBE_ROWS,
                  rounds: int = PROBE_ROUNDS, clock: Callable[[], float] = time.perf_counter
                  ) -> ProductTimes:
    """Time one pass over `product_shapes` ([out, in] each) at `rows` rows on the CPU:
    torch._int_mm on int8 operands against torch.mm on float32 ones."""
    gen = torch.Generator().manual_seed(0)
    floats = [(torch.randn(rows, i, generator=gen), torch.randn(i, o, generator=gen))
              for o, i in product_shapes]
    ints = [(torch.randint(-127, 128, (rows, i), dtype=torch.int8, generator=gen),
             torch.randint(-127, 128, (i, o), dtype=torch.int8, generator=gen))
            for o, i in product_shapes]
    return ProductTimes(rows, median_pass_s(ints, torch._int_mm, rounds=rounds, clock=clock),
                        median_pass_s(floats, torch.mm, rounds=rounds, clock=clock))


def available() -> bool:
    """Return whether this torch has the int8 x int8 -> int32 matrix product."""
    return hasattr(torch, "_int_mm")


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return a @ b in int32 for int8 a [M, K] and b [K, N], on any shape the device takes.

    The CPU's product takes any shape. CUDA's needs M > 16 and K, N multiples of 8: fewer
    rows are padded with zero rows (cut off after), and other widths are multiplied in
    float64, whose 53 bits hold any int8 sum of a realistic width exactly.
    """
    if a.device.type != "cuda":
        return torch._int_mm(a, b)
    if a.shape[1] % CUDA_MULTIPLE or b.shape[1] % CUDA_MULTIPLE:
        return (a.double() @ b.double()).to(torch.int32)
    rows = a.shape[0]
    if rows < CUDA_MIN_ROWS:
        a = torch.cat([a, a.new_zeros(CUDA_MIN_ROWS - rows, a.shape[1])])
        return torch._int_mm(a, b)[:rows]
    return torch._int_mm(a, b)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `x` [M, K] as int8 rows and each row's float32 scale [M, 1] (absmax / 127)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


class Int8EncoderWeight(nn.Module):
    """A linear weight [out, in] as int8 with one scale per output channel, for many rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # [in, out], contiguous: the layout the product reads, made once, not per call.
        # Named `q` like engine.quantize.Int8Weight's: what counts int8 bytes by name finds it.
        self.q = nn.Parameter(q.t().contiguous(), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.dtype = weight.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[1]), int(self.q.shape[0])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Return x @ W.T: x's rows quantized to int8 each, multiplied in int8, scaled back."""
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_rows(rows)
        y = int_mm(xq, self.q).float() * xs * self.scale
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])

    def dequantized(self) -> torch.Tensor:
        """Return the float weight this int8 weight stands for (q * scale)."""
        return (self.q.t().float() * self.scale[:, None]).to(self.dtype)


def is_int8_encoder_weight(w: object) -> bool:
    """Return whether a LeanT5 weight is an Int8EncoderWeight."""
    return isinstance(w, Int8EncoderWeight)
