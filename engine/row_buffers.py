"""One model's decode buffers for every row, allocated once at fixed addresses.

The rows' self-attention caches are slices of one tensor [rows (+ 1), L, 2, H, T + 1, d_kv];
where the fixed-row step may run, a last row is scratch, never a request's. Where it serves
(engine.t5.decode_fixed: a compiled step without the C step, several rows batched), each
row also has its cross-attention K/V padded to the longest bucket [rows + 1, L, 2, H, X,
d_kv] and its mask bias [rows + 1, 1, 1, X], filled when a request joins. The step then
reads the same tensors at the same addresses whichever rows are active and wherever they
are, so torch.compile makes one graph per batch-size class and CUDA graphs record each
once; its lanes that no request fills point at the scratch row.

    buffers = RowBuffers(m, rows=8, slots=264, cross_len=256, fixed=True, static=True)
    buffers.load(row, cross, mask_bias)  # a request joins row `row`
    tokens = buffers.step(fn, m, rows, tokens, positions, dec_bias)  # one step of `rows`
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.t5 import LeanT5


def batch_sizes(rows: int) -> tuple[int, ...]:
    """Return the batch-size classes of the fixed-row step for up to `rows` rows: powers of
    two from 2, and `rows` itself.

    Powers of two: a step runs at most twice the lanes it needs (the padding lanes cost
    their share of every product and attention), while the graphs to compile and record
    grow with log2(rows), not rows. One row never runs it (the one-row step serves).
    """
    sizes = []
    size = 2
    while size < rows:
        sizes.append(size)
        size *= 2
    if rows >= 2:
        sizes.append(rows)
    return tuple(sizes)


class RowBuffers:
    """The rows' self-attention caches (and, once `fixed`, their padded cross K/V and mask
    bias) as single tensors with a scratch row; see the module doc."""

    def __init__(self, m: LeanT5, *, rows: int, slots: int, cross_len: int,
                 scratch: bool, fixed: bool, static: bool, step_rows: int | None = None
                 ) -> None:
        """`cross_len`: the longest cross-attention length (bucket edge) a row holds;
        `scratch`: the fixed-row step may run (a scratch row for its unfilled lanes);
        `fixed`: allocate its cross buffers now (else make_fixed() does, on first need);
        `static`: mark the tensors as static inputs of compiled calls (their addresses
        never change: CUDA graphs read them in place, with no copy); `step_rows`: the most
        rows one step decodes, whose batch-size classes the fixed-row step has (None:
        `rows`; fewer where a row is admission's extra one, which decodes only while a
        synthetic row pauses: engine.scheduler)."""
        assert scratch or not fixed, "the fixed-row step needs the scratch row"
        self.rows = rows
        self.step_rows = rows if step_rows is None else step_rows
        self.scratch = rows  # its index (when it exists)
        self._has_scratch = scratch
        self.dtype = m.dtype
        self.device = m.device_
        self._m = m
        self._cross_len = cross_len
        self._static = static
        # Each row as LeanT5.new_self_cache makes one (its spare slot included).
        shape = (rows + scratch, len(m.dec_layers), 2, m.n_heads, slots + 1, m.d_kv)
        self.self_kv = torch.zeros(shape, dtype=m.dtype, device=m.device_)
        # Each row's cache is a view (the one-row step and the C step take one row).
        self.caches = [self.self_kv[r] for r in range(rows)]
        self.cross: torch.Tensor | None = None
        self.cross_bias: torch.Tensor | None = None
        self.sizes: tuple[int, ...] = ()
        self._mark(self.self_kv, *self.caches)
        if fixed:
            self.make_fixed()

    def _mark(self, *tensors: torch.Tensor) -> None:
        if self._static:
            from torch._dynamo import mark_static_address

            for t in tensors:
                mark_static_address(t, guard=False)

    def make_fixed(self) -> int:
        """Allocate the fixed-row step's cross K/V and mask buffers unless they are;
        return the bytes allocated (0: they were). Safe beside the loop: `fixed` turns
        true only once both exist."""
        if self.cross is not None:
            return 0
        assert self._has_scratch, "the fixed-row step needs the scratch row"
        m, rows, length = self._m, self.rows, self._cross_len
        with torch.no_grad():
            bias = torch.full((rows + 1, 1, 1, length), torch.finfo(m.dtype).min,
                              dtype=m.dtype, device=m.device_)
            cross = torch.zeros((rows + 1, len(m.dec_layers), 2, m.n_heads, length, m.d_kv),
                                dtype=m.dtype, device=m.device_)
        self._mark(cross, bias)
        self.sizes = batch_sizes(self.step_rows)
        self.cross_bias = bias
        self.cross = cross
        return cross.numel() * cross.element_size() + bias.numel() * bias.element_size()

    @property
    def fixed(self) -> bool:
        """Return whether the fixed-row step can run on these buffers (cross K/V held)."""
        return self.cross is not None

    def nbytes(self) -> int:
        """Return the bytes allocated: the caches (scratch row included) and cross buffers."""
        return sum(t.numel() * t.element_size()
                   for t in (self.self_kv, self.cross, self.cross_bias) if t is not None)

    def size_for(self, n: int) -> int:
        """Return the lanes of the fixed-row step that runs `n` rows: the smallest class."""
        return next(size for size in self.sizes if size >= n)

    def load(self, row: int, cross: torch.Tensor, mask_bias: torch.Tensor) -> None:
        """Copy a joining request's cross K/V [L, 2, H, B, d_kv] and mask bias [1, 1, 1, B]
        into row `row`; the slots after B are zero and masked (weight exactly 0)."""
        assert self.cross is not None and self.cross_bias is not None
        length = cross.shape[3]
        self.cross[row, :, :, :, :length].copy_(cross)
        self.cross[row, :, :, :, length:].zero_()
        self.cross_bias[row, :, :, :length].copy_(mask_bias[0])
        self.cross_bias[row, :, :, length:].fill_(torch.finfo(self.dtype).min)

    def step(self, fn: Callable[..., torch.Tensor], m: Any, rows: list[int],
             tokens: list[int], positions: list[int], dec_bias: torch.Tensor) -> list[int]:
        """Run the fixed-row step `fn` for requests on `rows` (each feeding its token at its
        position) in the smallest batch-size class; return their tokens."""
        n = len(rows)
        pad = self.size_for(n) - n
        out = self._call(fn, m, tokens + [0] * pad, positions + [0] * pad,
                         rows + [self.scratch] * pad, dec_bias)
        return [int(t) for t in out[:n].tolist()]

    def warm(self, fn: Callable[..., torch.Tensor], m: Any, size: int,
             dec_bias: torch.Tensor) -> None:
        """Call `fn` once with `size` lanes, every lane on the scratch row (no request's
        row is read or written: safe beside a running batch)."""
        self._call(fn, m, [0] * size, [0] * size, [self.scratch] * size, dec_bias)

    def _call(self, fn: Callable[..., torch.Tensor], m: Any, tokens: list[int],
              positions: list[int], lanes: list[int], dec_bias: torch.Tensor
              ) -> torch.Tensor:
        # The lanes' integers reach the device in one copy: rows of one tensor.
        ints = torch.tensor([tokens, positions, lanes], dtype=torch.long, device=self.device)
        return fn(m, ints[0], ints[1], ints[2], self.self_kv, self.cross, self.cross_bias,
                  dec_bias)
