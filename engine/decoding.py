"""Greedy decode loops: direct, and speculative with a draft model.

Both loops run on position-indexed static caches, return the chosen tokens and a
timestamp per token, and stop at EOS or `max_new` tokens. A token's timestamp is
when it became known on the host (its confirmation time): for a direct step call
that computes several tokens, the end of that call; for a speculative round, the
end of its verification. Tokens confirmed together share one timestamp.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.errors import Cancelled, RequestTimeout
from engine.protocol import SpecStats
from engine.runner import Fns, ModelRunner

if TYPE_CHECKING:
    from engine.row_buffers import RowBuffers

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
    if fns.encode is not runner.eager.encode:
        # It feeds every step: under CUDA graphs the encoder's next replay would overwrite
        # a compiled call's output, so the request holds its own copy.
        cross = cross.clone()
    return Encoded(cross, mask_bias)


def _check(deadline: float | None, clock: Clock, cancel: threading.Event | None,
           pause: Callable[[], None] | None = None) -> None:
    """Raise Cancelled or RequestTimeout at a step boundary; then `pause` (a synthetic
    request's engine.admission.PausePoint: it may wait there, its state untouched)."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("request cancelled")
    if deadline is not None and clock() > deadline:
        raise RequestTimeout("timeout_s: generation did not finish before the deadline")
    if pause is not None:
        pause()


def direct(runner: ModelRunner, fns: Fns, enc: Encoded, cache: torch.Tensor, max_new: int,
           deadline: float | None = None, clock: Clock = time.perf_counter,
           cancel: threading.Event | None = None, pause: Callable[[], None] | None = None
           ) -> Decoded:
    """Decode greedily, `runner.steps` tokens per step call and one host sync per call
    (`pause`: called between step calls, see _check)."""
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
            # The next replay overwrites `out` (another request's, while this one pauses).
            cur = out[-1:].view(1, 1).clone()
            _check(deadline, clock, cancel, pause)
    return Decoded(tokens, stamps, SpecStats(target_forwards=len(tokens)))


class RowState:
    """One request's decode between steps, so direct steps and speculative rounds interleave.

    Invariant between calls: `seq` holds the decoder tokens by position (the start token
    first), the target cache holds positions < len(seq) - 1, and the next input is seq[-1]
    at position len(seq) - 1; the draft cache holds positions < d_pos. A direct step
    (`accept`, the token computed by a batched step) and a round (`round`) both keep it, so
    every emitted token is the target's own argmax given the tokens before it, whatever ran.
    """

    def __init__(self, target: ModelRunner, tfns: Fns, tenc: Encoded, tcache: torch.Tensor,
                 max_new: int, *, draft: ModelRunner | None = None, dfns: Fns | None = None,
                 denc: Encoded | Callable[[], Encoded] | None = None,
                 dcache: torch.Tensor | None = None, k: int = 0,
                 clock: Clock = time.perf_counter) -> None:
        """`denc`: the draft's encoder output, or a function making it at the first round."""
        self.target, self.tfns, self.tenc, self.tcache = target, tfns, tenc, tcache
        self.draft, self.dfns, self.dcache = draft, dfns, dcache
        self.denc: Encoded | None = denc if isinstance(denc, Encoded) else None
        self._make_denc = denc if callable(denc) else None
        self.k, self.max_new, self.clock = k, max_new, clock
        # The rows' buffers (engine.row_buffers.RowBuffers) holding this request's cross K/V
        # at its row, set where the fixed-row compiled step may step it batched.
        self.buffers: RowBuffers | None = None
        tm = target.m
        self.seq = [tm.decoder_start_id]
        self._last: torch.Tensor | None = target.start  # seq[-1] on the device (see last)
        self.prev: torch.Tensor | None = None  # seq[-2] on the device after a full accept
        self.d_pos = 0
        self.tokens: list[int] = []
        self.stamps: list[float] = []
        self.done = False
        self.drafts = self.proposed = self.accepted = self.forwards = 0
        self.draft_steps = self.verifies = 0
        self.draft_s = self.verify_s = 0.0
        self.per_position = [0] * max(k, 0)
        # Between `propose` (or `drafted`) and `settle` (a batched verification): the
        # draft's position after the proposals, and the seconds the draft took.
        self._pending, self._proposed_s = 0, 0.0
        # The last proposal's parts: its draft encoder's seconds (0.0: it had run before)
        # and its k proposals' seconds (the batching loop's cost of a proposal).
        self.encoded_s = self.chain_s = 0.0
        if k > 0:
            q = target.verify_q
            if not 1 <= k < q:
                raise ValueError(f"k: must be between 1 and {q - 1}, got {k}")
            self.pad = torch.full((q - 1 - k,), tm.pad_id, dtype=torch.long,
                                  device=tm.device_)

    @property
    def last(self) -> torch.Tensor:
        """Return seq[-1] on the device as [1, 1] (made when first needed: a batched step
        feeds tokens from `seq`, so a row that only decodes batched never makes one)."""
        if self._last is None:
            self._last = torch.tensor([[self.seq[-1]]], device=self.target.m.device_)
        return self._last

    @property
    def position(self) -> int:
        """Return the position the next direct step feeds seq[-1] at."""
        return len(self.seq) - 1

    @property
    def can_speculate(self) -> bool:
        """Return whether this request has a draft to run rounds with."""
        return self.k > 0 and self.draft is not None

    def accept(self, token: int, now: float) -> None:
        """Take the target's greedy token for seq[-1] (a direct step just wrote its K/V)."""
        self.forwards += 1
        self.seq.append(token)
        self.tokens.append(token)
        self.stamps.append(now)
        self._last = None
        self.prev = None  # the draft catches up from `seq`
        if token == self.target.m.eos_id or len(self.tokens) >= self.max_new:
            self.done = True

    def round(self) -> None:
        """Run one speculative round: the draft proposes k tokens, the target checks them."""
        t0 = self.clock()
        props, d_pos = self._propose(self.k)
        k, tm, target, seq = self.k, self.target.m, self.target, self.seq
        t1 = self.clock()
        q = target.verify_q
        t_pos = len(seq) - 1
        block = torch.cat([self.last.view(1), props, self.pad]).view(1, q)
        choice_t = self.tfns.verify(tm, block, target.windows[t_pos], self.tcache,
                                    self.tenc.cross, self.tenc.mask_bias,
                                    target.bias_for(t_pos + q))
        both = torch.cat([block[0, 1:k + 1], choice_t[:k + 1]]).tolist()  # one sync a round
        now = self.clock()
        n = self._settle(both[:k], both[k:], d_pos, props, now, t1 - t0, now - t1)
        self._last = choice_t[n:n + 1].clone().view(1, 1)

    def propose(self, k: int) -> list[int]:
        """Run the draft for a batched verification (engine.scheduler): return the k + 1
        tokens to verify at positions `position` onward (seq[-1], then k proposals)."""
        t0 = self.clock()
        props, pending = self._propose(k)
        return self._proposal(props.tolist(), pending, self.clock() - t0)

    def draft_feed(self) -> list[int]:
        """Make the draft's encoder output if it has none; return what the draft is fed at
        d_pos onward for a proposal made with other rows' (engine.scheduler): the accepted
        tokens it has not seen, then seq[-1]."""
        self._draft_ready()
        return self.seq[self.d_pos:]

    def drafted(self, props: list[int], catch_up_s: float, chain_s: float) -> list[int]:
        """Take the k proposals the draft made from `draft_feed()` (its K/V written up to
        `position` + k - 1); return the block to verify, as `propose` does. `catch_up_s`
        and `chain_s`: this row's shares of the draft calls' seconds."""
        self.draft_steps += len(self.seq) - 1 - self.d_pos + len(props)
        self.d_pos = self.position
        self.chain_s = chain_s
        return self._proposal(props, self.position + len(props),
                              self.encoded_s + catch_up_s + chain_s)

    def _proposal(self, props: list[int], pending: int, seconds: float) -> list[int]:
        """Hold a proposal until `settle`: the draft's position after it and its seconds."""
        self._pending, self._proposed_s = pending, seconds
        return [self.seq[-1], *props]

    def settle(self, block: list[int], choice: list[int], now: float, verify_s: float) -> None:
        """Take a batched verification's greedy choices after `block` (what `propose`
        returned); `verify_s`: this row's share of the verification's seconds."""
        k = len(block) - 1
        # No device copy of the last proposal: the draft catches up on it from `seq`.
        self._settle(block[1:], choice[:k + 1], self._pending, None, now, self._proposed_s,
                     verify_s)

    def _propose(self, k: int) -> tuple[torch.Tensor, int]:
        """Run the draft: catch up on accepted tokens, then propose k tokens after seq[-1];
        return the proposals and the draft's position after them."""
        self._draft_ready()
        assert self.draft is not None and self.dfns is not None and self.denc is not None
        assert self.dcache is not None
        draft, dfns, denc, dcache = self.draft, self.dfns, self.denc, self.dcache
        dm, seq = draft.m, self.seq
        # The draft catches up on accepted tokens it has not seen (after a full accept, or
        # direct steps taken in a batch). Several at once in C: one call writes their K/V
        # (bitwise what one step each writes); its choices are not needed.
        gap = len(seq) - 1 - self.d_pos
        if gap > 1 and draft.native is not None and dfns.verify == draft.native.verify:
            block = torch.tensor([seq[self.d_pos:len(seq) - 1]], device=dm.device_)
            dfns.verify(dm, block, torch.arange(self.d_pos, len(seq) - 1), dcache, denc.cross,
                        denc.mask_bias, draft.bias_for(len(seq) - 1))
            self.d_pos += gap
            self.draft_steps += gap
        while self.d_pos < len(seq) - 1:
            tok = (self.prev if self.prev is not None and self.d_pos == len(seq) - 2
                   else torch.tensor([[seq[self.d_pos]]], device=dm.device_))
            dfns.step(dm, tok, draft.positions[self.d_pos], dcache, denc.cross,
                      denc.mask_bias, draft.bias_for(self.d_pos + 1), 1)
            self.d_pos += 1
            self.draft_steps += 1
        d_pos = self.d_pos
        t_chain = self.clock()
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=dm.device_), d_pos
        if dfns.chain:
            # The whole round in one call: each proposal feeds the next inside it.
            props = dfns.step(dm, self.last, draft.positions[d_pos], dcache, denc.cross,
                              denc.mask_bias, draft.bias_for(d_pos + k), k)
            d_pos += k
        else:
            cur, proposed_one = self.last, []
            for _ in range(k):
                nxt = dfns.step(dm, cur, draft.positions[d_pos], dcache, denc.cross,
                                denc.mask_bias, draft.bias_for(d_pos + 1), 1)
                d_pos += 1
                # Kept past later calls: under CUDA graphs a call's outputs are overwritten
                # by the next replay, so hold a copy (one int).
                proposed_one.append(nxt.clone())
                cur = proposed_one[-1].view(1, 1)
            props = torch.cat(proposed_one)
        self.draft_steps += k
        self.chain_s = self.clock() - t_chain
        return props, d_pos

    def _draft_ready(self) -> None:
        """Run the draft's encoder if it has not run (its seconds in `encoded_s`)."""
        self.encoded_s = 0.0
        if self.denc is None and self._make_denc is not None:
            t0 = self.clock()
            self.denc = self._make_denc()
            self.encoded_s = self.clock() - t0

    def _settle(self, proposals: list[int], choice: list[int], d_pos: int,
                props: torch.Tensor | None, now: float, draft_s: float,
                verify_s: float) -> int:
        """Emit the accepted prefix of `proposals` and the target's own next token (its
        greedy choices after seq[-1] and each proposal); return how many were accepted."""
        tm, seq, k = self.target.m, self.seq, len(proposals)
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.verifies += 1
        self.forwards += 1
        n = 0
        while n < k and proposals[n] == choice[n]:
            self.per_position[n] += 1
            n += 1
        self.drafts += 1
        self.proposed += k
        self.accepted += n
        emitted = proposals[:n] + [choice[n]]
        if tm.eos_id in emitted:
            emitted = emitted[: emitted.index(tm.eos_id) + 1]
            self.done = True
        emitted = emitted[: self.max_new - len(self.tokens)]
        seq.extend(emitted)
        self.d_pos = min(d_pos, len(seq) - 1)
        self._last = None  # made from seq[-1] when needed
        self.prev = props[-1:].view(1, 1) if n == k and props is not None and k else None
        self.stamps.extend([now] * len(emitted))  # confirmed together, by this verification
        self.tokens.extend(emitted)
        if len(self.tokens) >= self.max_new:
            self.done = True
        return n

    def decoded(self) -> Decoded:
        """Return what this request decoded so far."""
        spec = SpecStats(drafts=self.drafts, draft_tokens=self.proposed,
                         accepted_tokens=self.accepted,
                         accepted_per_position=tuple(self.per_position) if self.drafts else (),
                         target_forwards=self.forwards)
        return Decoded(self.tokens, self.stamps, spec,
                       RoundCosts(self.draft_steps, self.draft_s, self.verifies, self.verify_s))


def speculative(target: ModelRunner, tfns: Fns, tenc: Encoded, tcache: torch.Tensor,
                draft: ModelRunner, dfns: Fns, denc: Encoded, dcache: torch.Tensor,
                k: int, max_new: int, deadline: float | None = None,
                clock: Clock = time.perf_counter, cancel: threading.Event | None = None,
                pause: Callable[[], None] | None = None) -> Decoded:
    """Decode greedily: the draft proposes k tokens, the target checks them in one forward.

    The output equals direct greedy decoding of the target: every emitted token is
    the target's own argmax given the accepted prefix. Rejected positions are rolled
    back by moving the positions; the static caches mask every slot after a query.
    The verification always covers `target.verify_q` positions (one compiled shape for
    every k <= verify_q - 1); positions after the k proposals are padding, their choices
    unused and their cache slots rewritten before any query can see them. `pause` is
    called between rounds (see _check).
    """
    row = RowState(target, tfns, tenc, tcache, max_new, draft=draft, dfns=dfns, denc=denc,
                   dcache=dcache, k=k, clock=clock)
    while not row.done:
        row.round()
        if not row.done:
            _check(deadline, clock, cancel, pause)
    return row.decoded()
