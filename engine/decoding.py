"""Greedy decode loops: direct, and speculative with a draft model.

Both loops run on position-indexed static caches, return the chosen tokens and a
timestamp per token, and stop at EOS or `max_new` tokens. A token's timestamp is
when it became known on the host (its confirmation time): for a direct step call
that computes several tokens, the end of that call; for a speculative round, the
end of its verification. Tokens confirmed together share one timestamp.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.errors import RequestTimeout
from engine.protocol import SpecStats
from engine.runner import Fns, ModelRunner

Clock = Callable[[], float]


@dataclass(frozen=True)
class Encoded:
    """One model's encoder output for one request."""

    cross: torch.Tensor  # cross-attention K/V [L, 2, H, B, d_kv], allocated per request
    mask_bias: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Return the bytes this request's encoder output holds."""
        return self.cross.numel() * self.cross.element_size()


@dataclass(frozen=True)
class RoundCosts:
    """Seconds measured in a speculative request: draft steps and verifications."""

    draft_steps: int = 0
    draft_s: float = 0.0
    verifies: int = 0
    verify_s: float = 0.0


@dataclass(frozen=True)
class Decoded:
    """Tokens chosen (EOS included when produced) and when each was confirmed."""

    tokens: list[int]
    stamps: list[float]
    spec: SpecStats
    costs: RoundCosts = field(default_factory=RoundCosts)
    kv_request_bytes: int = 0  # set by the runtime: the encoder outputs this request held


def encode(runner: ModelRunner, fns: Fns, ids: torch.Tensor, attention_mask: torch.Tensor
           ) -> Encoded:
    """Run the encoder on padded ids [1, L] and return the cross-attention K/V."""
    m = runner.m
    mask_bias = m.mask_bias(attention_mask)
    cross = fns.encode(m, ids, mask_bias, runner.encoder_bias(ids.shape[1]))
    return Encoded(cross, mask_bias)


def _check(deadline: float | None, clock: Clock) -> None:
    if deadline is not None and clock() > deadline:
        raise RequestTimeout("timeout_s: generation did not finish before the deadline")


def direct(runner: ModelRunner, fns: Fns, enc: Encoded, cache: torch.Tensor, max_new: int,
           deadline: float | None = None, clock: Clock = time.perf_counter) -> Decoded:
    """Decode greedily, `runner.steps` tokens per step call and one host sync per call."""
    m = runner.m
    steps = runner.steps
    cur = runner.start
    tokens: list[int] = []
    stamps: list[float] = []
    pos = 0
    done = False
    while not done:
        out = fns.step(m, cur, runner.positions[pos], cache, enc.cross, enc.mask_bias,
                       runner.bias_for(pos + steps), steps)
        chunk = out.tolist()
        now = clock()
        for token in chunk:
            tokens.append(token)
            stamps.append(now)
            if token == m.eos_id or len(tokens) >= max_new:
                done = True
                break
        pos += steps
        if not done:
            _check(deadline, clock)
            cur = out[-1:].view(1, 1)
    return Decoded(tokens, stamps, SpecStats(target_forwards=len(tokens)))


def speculative(target: ModelRunner, tfns: Fns, tenc: Encoded, tcache: torch.Tensor,
                draft: ModelRunner, dfns: Fns, denc: Encoded, dcache: torch.Tensor,
                k: int, max_new: int, deadline: float | None = None,
                clock: Clock = time.perf_counter) -> Decoded:
    """Decode greedily: the draft proposes k tokens, the target checks them in one forward.

    The output equals direct greedy decoding of the target: every emitted token is
    the target's own argmax given the accepted prefix. Rejected positions are rolled
    back by moving the positions; the static caches mask every slot after a query.
    The verification always covers `target.verify_q` positions (one compiled shape for
    every k <= verify_q - 1); positions after the k proposals are padding, their choices
    unused and their cache slots rewritten before any query can see them.
    """
    tm, dm = target.m, draft.m
    q = target.verify_q
    if not 1 <= k < q:
        raise ValueError(f"k: must be between 1 and {q - 1}, got {k}")
    pad = torch.full((q - 1 - k,), tm.pad_id, dtype=torch.long, device=tm.device_)
    seq = [tm.decoder_start_id]  # decoder tokens by position; seq[-1] not yet in the target cache
    last = target.start  # seq[-1] on the device
    prev: torch.Tensor | None = None  # seq[-2] on the device after a full accept
    d_pos = 0  # the draft cache holds positions < d_pos
    tokens: list[int] = []
    stamps: list[float] = []
    drafts = proposed = accepted = forwards = 0
    draft_steps = verifies = 0
    draft_s = verify_s = 0.0
    per_position = [0] * k
    done = False
    while not done and len(tokens) < max_new:
        t0 = clock()
        # The draft catches up on accepted tokens it has not seen (after a full accept).
        while d_pos < len(seq) - 1:
            tok = (prev if prev is not None and d_pos == len(seq) - 2
                   else torch.tensor([[seq[d_pos]]], device=dm.device_))
            dfns.step(dm, tok, draft.positions[d_pos], dcache, denc.cross, denc.mask_bias,
                      draft.bias_for(d_pos + 1), 1)
            d_pos += 1
            draft_steps += 1
        if dfns.chain:
            # The whole round in one call: each proposal feeds the next inside it.
            props = dfns.step(dm, last, draft.positions[d_pos], dcache, denc.cross,
                              denc.mask_bias, draft.bias_for(d_pos + k), k)
            d_pos += k
        else:
            cur, proposed_one = last, []
            for _ in range(k):
                nxt = dfns.step(dm, cur, draft.positions[d_pos], dcache, denc.cross,
                                denc.mask_bias, draft.bias_for(d_pos + 1), 1)
                d_pos += 1
                # Kept past later calls: under CUDA graphs a call's outputs are overwritten
                # by the next replay, so hold a copy (one int).
                proposed_one.append(nxt.clone())
                cur = nxt.view(1, 1)
            props = torch.cat(proposed_one)
        draft_steps += k
        t1 = clock()
        t_pos = len(seq) - 1
        block = torch.cat([last.view(1), props, pad]).view(1, q)
        choice_t = tfns.verify(tm, block, target.windows[t_pos], tcache, tenc.cross,
                               tenc.mask_bias, target.bias_for(t_pos + q))
        both = torch.cat([block[0, 1:k + 1], choice_t[:k + 1]]).tolist()  # one sync per round
        now = clock()
        draft_s += t1 - t0
        verify_s += now - t1
        verifies += 1
        proposals, choice = both[:k], both[k:]
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
        last = choice_t[n:n + 1].clone().view(1, 1)
        prev = props[-1:].view(1, 1) if n == k else None
        stamps.extend([now] * len(emitted))  # confirmed together, by this verification
        tokens.extend(emitted)
        if not done:
            _check(deadline, clock)
    return Decoded(tokens, stamps,
                   SpecStats(drafts=drafts, draft_tokens=proposed, accepted_tokens=accepted,
                             accepted_per_position=tuple(per_position),
                             target_forwards=forwards),
                   RoundCosts(draft_steps, draft_s, verifies, verify_s))
