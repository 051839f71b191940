"""int8 weights for the encoder's multi-row products (engine.quantization: int8).

The decoder step's int8 weights are read by the C step (engine.native), one row of
activations at a time. The encoder multiplies every input token at once, where the C
step's kernel and `linear(x, q.to(float)) * scale` both lose to float32; the quantized
engine's `quantized::linear_dynamic` (fbgemm's int8 GEMM, weights prepacked once) is the
int8 product that can win there (docs/engine.md#the-int8-encoder). Its activations are
quantized per call and per tensor, to 7 bits (reduce_range: AVX2's `maddubs` would
saturate its int16 pair sums with 8); dividing each row by its absmax first gives every
row the whole range, so the rounding is per row, as in the C step.

`PackedInt8Weight` holds only the prepacked weights (fbgemm's layout, one int8 copy; the
float weight and the int8 tensor it was packed from are not kept) and reports their bytes
(`nbytes`), which engine.memory and engine.quantize count: they are not a tensor.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

# Encoder products the int8 target multiplies in int8 (the decoder's cross K/V projection
# runs in the encoder too); engine.quantize decides per model whether they are used.
ENCODER_WEIGHTS = ("qkv", "o", "wi", "wo")


def available() -> bool:
    """Return whether this torch has the quantized engine's dynamic int8 linear."""
    return (hasattr(torch.ops.quantized, "linear_dynamic")
            and torch.backends.quantized.engine in ("x86", "fbgemm", "onednn"))


class PackedInt8Weight(nn.Module):
    """A linear weight [out, in] as int8 with one scale per output channel, prepacked."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.detach().float().cpu()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch deprecates qint8 tensors
            qw = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0)
            self.packed: Any = torch.ops.quantized.linear_prepack(qw, None)
        self.shape = (int(w.shape[0]), int(w.shape[1]))
        self.dtype = weight.dtype
        # The packed int8 values and a float scale per output channel.
        self.nbytes = self.shape[0] * self.shape[1] + 4 * self.shape[0]

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Return x @ W.T: each row scaled to absmax 1, multiplied in int8, scaled back."""
        top = x.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
        y = torch.ops.quantized.linear_dynamic((x / top).float().contiguous(), self.packed,
                                               True)
        return (y * top).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """Return the float weight this int8 weight stands for (q * scale)."""
        qw, _bias = torch.ops.quantized.linear_unpack(self.packed)
        return qw.dequantize().to(self.dtype)


def is_packed(w: object) -> bool:
    """Return whether a LeanT5 weight is a PackedInt8Weight."""
    return isinstance(w, PackedInt8Weight)


def packed_bytes(module: nn.Module) -> int:
    """Return the bytes of the PackedInt8Weights in `module` (they are not parameters)."""
    return sum(m.nbytes for m in module.modules() if isinstance(m, PackedInt8Weight))
