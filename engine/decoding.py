"""Greedy decode loops: direct, and speculative with a draft model.

Both loops run on position-indexed static caches, return the chosen tokens and
a timestamp per token (time.perf_counter), and stop at EOS or `max_new` tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.errors import RequestTimeout
from engine.protocol import SpecStats
from engine.runner import Fns, ModelRunner


@dataclass(frozen=True)
class Encoded:
    """One model's encoder output for one request."""

    cross_k: list[torch.Tensor]
    cross_v: list[torch.Tensor]
    mask_bias: torch.Tensor


@dataclass(frozen=True)
class Decoded:
    """Tokens chosen (EOS included when produced) and when each was chosen."""

    tokens: list[int]
    stamps: list[float]
    spec: SpecStats


def encode(runner: ModelRunner, fns: Fns, ids: torch.Tensor, attention_mask: torch.Tensor
           ) -> Encoded:
    """Run the encoder on padded ids [1, L] and return the cross-attention K/V."""
    m = runner.m
    mask_bias = m.mask_bias(attention_mask)
    ck, cv = fns.encode(m, ids, mask_bias, runner.encoder_bias(ids.shape[1]))
    return Encoded(ck, cv, mask_bias)


def _check(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise RequestTimeout("timeout_s: generation did not finish before the deadline")


def direct(runner: ModelRunner, fns: Fns, enc: Encoded,
           cache: tuple[list[torch.Tensor], list[torch.Tensor]], max_new: int,
           deadline: float | None = None) -> Decoded:
    """Decode greedily one token per target step."""
    m = runner.m
    sk, sv = cache
    cur = torch.full((1, 1), m.decoder_start_id, dtype=torch.long, device=m.device_)
    tokens: list[int] = []
    stamps: list[float] = []
    for pos in range(max_new):
        nxt = fns.step(m, cur, runner.positions[pos], sk, sv, enc.cross_k, enc.cross_v,
                       enc.mask_bias, runner.dec_bias)
        token = int(nxt.item())
        stamps.append(time.perf_counter())
        tokens.append(token)
        if token == m.eos_id:
            break
        _check(deadline)
        cur = nxt.view(1, 1)
    return Decoded(tokens, stamps, SpecStats(target_forwards=len(tokens)))


def speculative(target: ModelRunner, tfns: Fns, tenc: Encoded,
                tcache: tuple[list[torch.Tensor], list[torch.Tensor]],
                draft: ModelRunner, dfns: Fns, denc: Encoded,
                dcache: tuple[list[torch.Tensor], list[torch.Tensor]],
                k: int, max_new: int, deadline: float | None = None) -> Decoded:
    """Decode greedily: the draft proposes k tokens, the target checks them in one forward.

    The output equals direct greedy decoding of the target: every emitted token is
    the target's own argmax given the accepted prefix. Rejected positions are rolled
    back by moving the positions; the static caches mask every slot after a query.
    """
    tm, dm = target.m, draft.m
    sk, sv = tcache
    dk, dv = dcache
    seq = [tm.decoder_start_id]  # decoder tokens by position; seq[-1] not yet in the target cache
    d_pos = 0  # the draft cache holds positions < d_pos
    tokens: list[int] = []
    stamps: list[float] = []
    drafts = proposed = accepted = forwards = 0
    per_position = [0] * k
    done = False
    while not done and len(tokens) < max_new:
        round_start = time.perf_counter()
        # The draft catches up on accepted tokens it has not seen (after a full accept).
        while d_pos < len(seq) - 1:
            tok = torch.tensor([[seq[d_pos]]], device=dm.device_)
            dfns.step(dm, tok, draft.positions[d_pos], dk, dv, denc.cross_k, denc.cross_v,
                      denc.mask_bias, draft.dec_bias)
            d_pos += 1
        cur = torch.tensor([[seq[-1]]], device=dm.device_)
        proposals: list[int] = []
        for _ in range(k):
            nxt = dfns.step(dm, cur, draft.positions[d_pos], dk, dv, denc.cross_k, denc.cross_v,
                            denc.mask_bias, draft.dec_bias)
            d_pos += 1
            proposals.append(int(nxt.item()))
            cur = nxt.view(1, 1)
        t_pos = len(seq) - 1
        block = torch.tensor([[seq[-1], *proposals]], device=tm.device_)
        choice = tfns.verify(tm, block, target.windows[t_pos], sk, sv, tenc.cross_k,
                             tenc.cross_v, tenc.mask_bias, target.dec_bias).tolist()
        forwards += 1
        n = 0
        while n < k and proposals[n] == choice[n]:
            per_position[n] += 1
            n += 1
        drafts += 1
        proposed += k
        accepted += n
        emitted = proposals[:n] + [choice[n]]
        if tm.eos_id in emitted:
            emitted = emitted[: emitted.index(tm.eos_id) + 1]
            done = True
        emitted = emitted[: max_new - len(tokens)]
        seq.extend(emitted)
        d_pos = min(d_pos, len(seq) - 1)
        round_end = time.perf_counter()
        share = (round_end - round_start) / len(emitted)
        stamps.extend(round_start + share * (i + 1) for i in range(len(emitted)))
        tokens.extend(emitted)
        if not done:
            _check(deadline)
    return Decoded(tokens, stamps, SpecStats(drafts=drafts, draft_tokens=proposed,
                                             accepted_tokens=accepted,
                                             accepted_per_position=tuple(per_position),
                                             target_forwards=forwards))
