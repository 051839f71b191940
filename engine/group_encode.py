"""Arrivals of one bucket encoded together: the target's encoder on several inputs in one call.

The batching loop takes its new requests between steps; those of one bucket edge on one
target (engine.rows.Rows.group_key) run `engine.t5.encode_batch` once instead of the
batch-1 encoder each, and each request keeps its own row of the result. The loop needs each
row to be, bit for bit, what the batch-1 encoder gives that input alone (the tokens must
not depend on who arrived with whom), so a bucket edge is grouped only after warm-up
checked it (`warm`) and only from GROUP_MIN_LENGTH tokens: MKL's products of fewer rows
than that give a row a different sum depending on the call's other rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.decoding import Encoded
from engine.runner import ModelRunner

log = logging.getLogger(__name__)

GROUP_MIN_LENGTH = 9  # tokens per input (the rows of each product) below which none group
GROUP_MAX = 8  # inputs per grouped call: the batch sizes warm-up compiles and checks

OnLoop = Callable[[Callable[[], Any]], Any]


def encode(runner: ModelRunner, ids: list[torch.Tensor], masks: list[torch.Tensor]
           ) -> list[Encoded]:
    """Encode padded inputs [1, L] of one length in one call; return each one's output."""
    m = runner.m
    mask_biases = [m.mask_bias(mask) for mask in masks]
    cross = runner.encoder_rows()(m, torch.cat(ids), torch.cat(mask_biases),
                                  runner.encoder_bias(ids[0].shape[1]))
    # Each request holds its own copy (as decoding.encode copies a compiled output).
    return [Encoded(cross[i].clone(), bias) for i, bias in enumerate(mask_biases)]


def warm(runner: ModelRunner, edge: int, size: int, on_loop: OnLoop) -> None:
    """Compile `runner`'s grouped encoder and check bucket `edge` at 2..`size` inputs;
    group the edge's arrivals from now on only if every row was bitwise the batch-1
    encoder's (else stop grouping on this runner, said once)."""
    if (size < 2 or edge < GROUP_MIN_LENGTH or runner.group_off is not None
            or edge in runner.group_edges):
        return
    alone = runner.compiled(edge).encode
    if alone is runner.eager.encode:
        return  # no compiled encoder: nothing to be bitwise with
    try:
        _compile(runner, edge)
        # Checked where requests will run it: on the loop's thread.
        why = on_loop(lambda: _differs(runner, alone, edge, size))
    except Exception as exc:  # noqa: BLE001 - the bucket still serves, each input alone
        why = f"the grouped encoder failed at {edge} tokens: {type(exc).__name__}: {exc}"[:300]
    if why is None:
        runner.group_edges.add(edge)
        return
    runner.group_off = why
    runner.group_edges.clear()
    log.warning("engine: %s: arrivals are encoded one by one: %s", runner.name, why)


def _compile(runner: ModelRunner, edge: int) -> None:
    """Compile `runner`'s grouped encoder (on first use) on 2 dummy inputs of `edge`."""
    m = runner.m
    with torch.no_grad():
        # The batch and the length dynamic: traced at 2 inputs, every larger group and
        # every bucket edge runs the same graph.
        grouped = runner.encoder_rows()
        enc = runner._encode_example(edge)
        ids = enc[1].expand(2, edge).contiguous()
        bias = enc[2].expand(2, *enc[2].shape[1:]).contiguous()
        for tensor, dims in ((ids, (0, 1)), (bias, (0, 3))):
            for dim in dims:
                torch._dynamo.mark_dynamic(tensor, dim)
        grouped(m, ids, bias, enc[3])


def _differs(runner: ModelRunner, alone: Callable, edge: int, size: int) -> str | None:
    """Return how the grouped encoder differs from `alone` on synthetic inputs of `edge`
    tokens, 2..`size` at a time (None: every row bitwise the same)."""
    m = runner.m
    gen = torch.Generator().manual_seed(edge)
    ids = torch.randint(3, m.vocab_size, (size, edge), generator=gen).to(m.device_)
    masks = []
    for i in range(size):
        real = 2 + (edge - 2) * i // max(size - 1, 1)  # from 2 tokens to the whole bucket
        ids[i, real:] = m.pad_id
        mask = torch.zeros((1, edge), dtype=torch.long, device=m.device_)
        mask[0, :real] = 1
        masks.append(mask)
    inputs = [ids[i:i + 1] for i in range(size)]
    enc_bias = runner.encoder_bias(edge)
    with torch.no_grad():
        expected = [alone(m, x, m.mask_bias(mask), enc_bias).clone()
                    for x, mask in zip(inputs, masks, strict=True)]
        for b in range(2, size + 1):
            got = encode(runner, inputs[:b], masks[:b])
            for i in range(b):
                if not torch.equal(got[i].cross, expected[i]):
                    return (f"at {edge} tokens, input {i + 1} of {b} encoded together is "
                            "not bitwise the batch-1 encoder's")
    return None
