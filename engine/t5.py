"""A lean T5 forward built from a Hugging Face T5 checkpoint's weights.

HF's T5 spends most of a small model's decode step in Python dispatch (cache
objects, mask builders, kwargs plumbing). These functions take the weights, the
inputs and a position-indexed static self-attention cache and nothing else, so
torch.compile sees a small static graph and eager runs stay cheap too.

Shapes: batch size 1 (decode_rows, decode_fixed: several requests' rows in one step); B = padded
input length; T = self-attention cache slots;
q = decoder positions computed in one call (1 for a step, k+1 for verification);
L = decoder layers. Caches are single tensors: the self-attention cache is
[L, 2 (K, V), H, T, d_kv] and the cross-attention K/V [L, 2, H, B, d_kv], so a compiled
step has few inputs (each is a guard and an argument to marshal on every call) and the one
tensor it mutates can be marked static (CUDA graphs need mutated inputs at fixed addresses).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def _activation(name: str):
    if name == "relu":
        return F.relu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"dense_act_fn: unsupported activation {name!r}")


def relative_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                    max_distance: int) -> torch.Tensor:
    """Map relative positions to T5's bias buckets (same math as HF)."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).to(torch.long) * num_buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (
        torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative, large)


def decoder_layers(cfg: Any) -> int:
    """Return the decoder's layer count (num_decoder_layers, else num_layers)."""
    return int(getattr(cfg, "num_decoder_layers", None) or cfg.num_layers)


class _NameRecorder(dict):
    """Record the names LeanT5 reads, answering each with a one-element tensor (not on the
    meta device: torch.cat's meta kernel imports torch._dynamo, which slows every start)."""

    def __contains__(self, name: object) -> bool:
        return False  # an optional weight (the untied lm_head) counts as absent

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = torch.zeros((1, 1))
        return self[name]


def required_weights(cfg: Any) -> list[str]:
    """Return the checkpoint names LeanT5 needs for `cfg` (an untied lm_head is optional)."""
    names = _NameRecorder()
    LeanT5(cfg, names, dtype=torch.float32, device=torch.device("cpu"))
    return list(names)


class LeanT5(nn.Module):
    """T5 weights rearranged for a tight forward (frozen, inference only)."""

    # Per-layer weight bags (nn.Module used as a namespace): attribute types vary by layer.
    enc_layers: Any
    dec_layers: Any

    def __init__(self, config: Any, weights: Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype, device: torch.device):
        """Build from a T5 / mT5 config and its checkpoint's tensors by HF name."""
        super().__init__()
        cfg = config
        self.d_model = cfg.d_model
        self.n_heads = cfg.num_heads
        self.d_kv = cfg.d_kv
        self.inner = cfg.num_heads * cfg.d_kv
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.layer_norm_epsilon
        self.gated = bool(cfg.is_gated_act)
        self.act = _activation(cfg.dense_act_fn)
        self.act_name = str(cfg.dense_act_fn)
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.decoder_start_id = int(cfg.decoder_start_token_id or 0)
        self.eos_id = int(cfg.eos_token_id if cfg.eos_token_id is not None else 1)
        self.pad_id = int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        # HF T5 scales when its config says so (v1.0); MT5 has no such field and never scales.
        scale = bool(getattr(cfg, "scale_decoder_outputs", False))
        self.output_scale = cfg.d_model ** -0.5 if scale else 1.0
        self.dtype = dtype
        self.device_ = device

        def w(*names: str) -> nn.Parameter:
            t = torch.cat([weights[n] for n in names], 0) if len(names) > 1 else weights[names[0]]
            return nn.Parameter(t.detach().to(device=device, dtype=dtype).contiguous(),
                                requires_grad=False)

        self.embed = w("shared.weight")
        # As HF loads it: the checkpoint's own lm_head, else the tied embedding.
        self.lm_head = w("lm_head.weight" if "lm_head.weight" in weights else "shared.weight")
        self.enc_rel = w("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        self.dec_rel = w("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        self.enc_final = w("encoder.final_layer_norm.weight")
        self.dec_final = w("decoder.final_layer_norm.weight")
        self.enc_layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            att, ff = f"encoder.block.{i}.layer.0.", f"encoder.block.{i}.layer.1."
            layer = nn.Module()
            layer.ln_att = w(att + "layer_norm.weight")
            a = att + "SelfAttention."
            layer.qkv = w(a + "q.weight", a + "k.weight", a + "v.weight")
            layer.o = w(a + "o.weight")
            self._ff(layer, ff, w)
            self.enc_layers.append(layer)
        self.dec_layers = nn.ModuleList()
        for i in range(decoder_layers(cfg)):
            att, cross, ff = (f"decoder.block.{i}.layer.{j}." for j in range(3))
            layer = nn.Module()
            layer.ln_att = w(att + "layer_norm.weight")
            a = att + "SelfAttention."
            layer.qkv = w(a + "q.weight", a + "k.weight", a + "v.weight")
            layer.o = w(a + "o.weight")
            c = cross + "EncDecAttention."
            layer.ln_cross = w(cross + "layer_norm.weight")
            layer.cq = w(c + "q.weight")
            layer.ckv = w(c + "k.weight", c + "v.weight")
            layer.co = w(c + "o.weight")
            self._ff(layer, ff, w)
            self.dec_layers.append(layer)

    def _ff(self, layer: Any, ff: str, w: Callable[..., Any]) -> None:
        layer.ln_ff = w(ff + "layer_norm.weight")
        d = ff + "DenseReluDense."
        layer.wi = w(d + "wi_0.weight", d + "wi_1.weight") if self.gated else w(d + "wi.weight")
        layer.wo = w(d + "wo.weight")

    # --- precomputed tables -------------------------------------------------------

    def encoder_bias(self, length: int) -> torch.Tensor:
        """Return the encoder's relative position bias [1, H, length, length]."""
        pos = torch.arange(length, device=self.device_)
        rel = pos[None, :] - pos[:, None]
        b = relative_bucket(rel, True, self.num_buckets, self.max_distance)
        return self.enc_rel[b].permute(2, 0, 1).unsqueeze(0).contiguous()

    def decoder_bias(self, slots: int) -> torch.Tensor:
        """Return the decoder's causal self-attention bias [H, slots(query), slots(key)]."""
        pos = torch.arange(slots, device=self.device_)
        rel = pos[None, :] - pos[:, None]
        b = relative_bucket(rel, False, self.num_buckets, self.max_distance)
        bias = self.dec_rel[b].permute(2, 0, 1)
        # Keys after the query are masked: this also hides stale slots left by a rollback.
        causal = pos[None, :] > pos[:, None]
        return bias.masked_fill(causal, torch.finfo(self.dtype).min).contiguous()

    def mask_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Turn a [1, B] 0/1 mask into an additive [1, 1, 1, B] bias."""
        keep = attention_mask.to(torch.bool)[:, None, None, :]
        zero = torch.zeros((), dtype=self.dtype, device=self.device_)
        neg = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device_)
        return torch.where(keep, zero, neg)

    def new_self_cache(self, slots: int, *, static: bool = True) -> torch.Tensor:
        """Allocate a self-attention cache [L, 2, H, slots + 1, d_kv]; `static`: marked as a
        static input for compiled steps (the C step needs no mark, nor torch._dynamo)."""
        # One spare slot, never written or attended: every attended span is then a strict
        # prefix of the cache, never the whole of it, so torch.compile keeps the span symbolic
        # (a prefix as long as the cache is contiguous, which torch would specialize on).
        cache = torch.zeros((len(self.dec_layers), 2, self.n_heads, slots + 1, self.d_kv),
                            dtype=self.dtype, device=self.device_)
        # Every step writes it in place: a static address (allocated once per stream, never
        # guarded on) lets cudagraph trees capture the step instead of skipping it.
        if static:
            torch._dynamo.mark_static_address(cache, guard=False)
        return cache

    def _kv_bytes(self, positions: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.dec_layers) * self.n_heads * positions * self.d_kv * elem

    def self_cache_bytes(self, slots: int) -> int:
        """Return the bytes of one self-attention cache with `slots` positions (+1 spare)."""
        return self._kv_bytes(slots + 1)

    def cross_cache_bytes(self, length: int) -> int:
        """Return the bytes of the cross-attention K/V for an input of `length`."""
        return self._kv_bytes(length)


def _linear(x: torch.Tensor, w: Any) -> torch.Tensor:
    # A weight is a float tensor, or an engine.quantize.Int8Weight (engine.quantization: int8).
    if not isinstance(w, torch.Tensor):
        return w.linear(x)
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.numel() == x.shape[-1]:
        # One row compiled on CPU: a reduction inductor fuses with its neighbours, where an
        # MKL call per 1-row product pays its fixed overhead dozens of times per token
        # (docs/engine.md#torchcompile). Eager and multi-row calls keep MKL.
        return (x.unsqueeze(-2) * w).sum(-1)
    return F.linear(x, w)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps)).to(weight.dtype)


def _clamp_fp16(x: torch.Tensor, *, per_row: bool = False) -> torch.Tensor:
    """Clamp float16 hidden states as Hugging Face's T5 block does (else return `x`).

    A real checkpoint's residual stream can pass float16's max (65504) and turn inf, then
    NaN. HF clamps after each sub-layer to the largest finite value (max - 1000 once any
    value is inf); the same expression here keeps float16 outputs those of HF. `per_row`
    (decode_rows: rows of different requests in one sequence): each row [.., D] decides on
    its own infs, so a row batched is clamped as it would be alone.
    """
    if x.dtype != torch.float16:  # a Python check: no graph cost for float32 / bfloat16
        return x
    if per_row:  # a limit per row: a float32 tensor of them would promote x to float32
        inf = torch.isinf(x).any(-1, keepdim=True)
        clamp_value = torch.where(inf, torch.finfo(x.dtype).max - 1000,
                                  torch.finfo(x.dtype).max).to(x.dtype)
    else:
        clamp_value = torch.where(torch.isinf(x).any(), torch.finfo(x.dtype).max - 1000,
                                  torch.finfo(x.dtype).max)
    return torch.clamp(x, min=-clamp_value, max=clamp_value)


def _ff(m: LeanT5, layer: Any, x: torch.Tensor) -> torch.Tensor:
    h = _norm(x, layer.ln_ff, m.eps)
    h = _linear(h, layer.wi)
    if m.gated:
        gate, lin = h.chunk(2, dim=-1)
        h = m.act(gate) * lin
    else:
        h = m.act(h)
    return x + _linear(h, layer.wo)


def _heads(m: LeanT5, x: torch.Tensor) -> torch.Tensor:
    return x.view(1, x.shape[1], m.n_heads, m.d_kv).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # T5 does not scale q.k: the bias carries the positions and the mask.
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def _attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
                   ) -> torch.Tensor:
    # q [H, q, d], k/v [H, span, d]: a prefix of the cache (span symbolic when compiled),
    # multiplied as 3-d batches (no broadcast of a leading batch dimension to reshape).
    scores = torch.bmm(q, k.transpose(1, 2)) + bias
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.bmm(probs, v)
    return out.transpose(0, 1).reshape(1, q.shape[1], -1)


def _attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
                  ) -> torch.Tensor:
    # One kernel: the [1, H, L, L] scores and their softmax are never written out, which is
    # most of an eager small encoder's time at long inputs. Unscaled, as _attend.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)


def encode(m: LeanT5, ids: torch.Tensor, mask_bias: torch.Tensor, enc_bias: torch.Tensor,
           attend: Callable = _attend) -> torch.Tensor:
    """Run the encoder and return the decoder's cross-attention K/V [L, 2, H, B, d_kv]."""
    x = F.embedding(ids, m.embed)
    bias = enc_bias + mask_bias
    for layer in m.enc_layers:
        h = _norm(x, layer.ln_att, m.eps)
        q, k, v = _linear(h, layer.qkv).split(m.inner, dim=-1)
        x = x + _linear(attend(_heads(m, q), _heads(m, k), _heads(m, v), bias), layer.o)
        x = _clamp_fp16(x)
        x = _clamp_fp16(_ff(m, layer, x))
    x = _norm(x, m.enc_final, m.eps)
    kv = [_linear(x, layer.ckv).view(x.shape[1], 2, m.n_heads, m.d_kv).permute(1, 2, 0, 3)
          for layer in m.dec_layers]
    return torch.stack(kv)


def encode_fused(m: LeanT5, ids: torch.Tensor, mask_bias: torch.Tensor,
                 enc_bias: torch.Tensor) -> torch.Tensor:
    """Run `encode` with each layer's attention in one fused call (within float rounding of
    `encode`, not bitwise): the encoder that runs eagerly, the draft's."""
    return encode(m, ids, mask_bias, enc_bias, _attend_fused)


def _clamp_inputs(x: torch.Tensor) -> torch.Tensor:
    """Clamp each input of a batch [B, length, D] as `encode` clamps it alone."""
    if x.dtype != torch.float16:
        return x
    return torch.cat([_clamp_fp16(x[i:i + 1]) for i in range(x.shape[0])])


def encode_batch(m: LeanT5, ids: torch.Tensor, mask_bias: torch.Tensor,
                 enc_bias: torch.Tensor) -> torch.Tensor:
    """Run the encoder on B inputs of one padded length and return their cross K/V
    [B, L, 2, H, length, d_kv]; `mask_bias` [B, 1, 1, length] (each input's own)."""
    # The batching loop's arrivals of one bucket (engine.group_encode), only where warm-up
    # found each row bitwise what `encode`'s compiled graph gives that input alone.
    b, n = ids.shape
    x = F.embedding(ids, m.embed)
    bias = enc_bias + mask_bias

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, n, m.n_heads, m.d_kv).transpose(1, 2)

    for layer in m.enc_layers:
        h = _norm(x, layer.ln_att, m.eps)
        q, k, v = _linear(h, layer.qkv).split(m.inner, dim=-1)
        scores = torch.matmul(heads(q), heads(k).transpose(-1, -2)) + bias
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        att = torch.matmul(probs, heads(v)).transpose(1, 2).reshape(b, n, -1)
        x = _clamp_inputs(x + _linear(att, layer.o))
        x = _clamp_inputs(_ff(m, layer, x))
    x = _norm(x, m.enc_final, m.eps)
    kv = [_linear(x, layer.ckv).view(b, n, 2, m.n_heads, m.d_kv).permute(0, 2, 3, 1, 4)
          for layer in m.dec_layers]
    return torch.stack(kv, 1)


def decode_logits(m: LeanT5, tokens: torch.Tensor, pos: torch.Tensor, self_kv: torch.Tensor,
                  cross_kv: torch.Tensor, cross_bias: torch.Tensor, dec_bias: torch.Tensor
                  ) -> torch.Tensor:
    """Run the decoder on tokens [1, q] at positions `pos` [q]; write the cache; return logits.

    The self-attention cache is indexed by absolute position, so rolling back a
    speculative round is just moving the position: slots after a query are masked
    by `dec_bias`, and they are overwritten before any later query can see them.
    """
    x = F.embedding(tokens, m.embed)
    # Only the first `span` slots are attended: `dec_bias` is the [H, span, span] corner of
    # the full table (span >= every position here), so a step early in the answer reads a
    # short prefix of the cache instead of all T slots. Under torch.compile the span is a
    # dynamic dimension (engine.runner.ModelRunner.bias_for): one graph serves every span.
    span = dec_bias.shape[-1]
    self_bias = dec_bias.index_select(1, pos)  # [H, q, span]
    q_len = tokens.shape[1]
    for i, layer in enumerate(m.dec_layers):
        h = _norm(x, layer.ln_att, m.eps)
        qkv = _linear(h, layer.qkv).view(q_len, 3, m.n_heads, m.d_kv).permute(1, 2, 0, 3)
        # K and V of these positions, one write into the cache tensor itself: written through
        # the view self_kv[i], inductor copied the whole layer's cache and wrote the whole
        # cache back on every call (the whole cache per token); an index_put_ on the base
        # (the layer as a tensor index) is done in place.
        layer_ix = torch.full((1,), i, dtype=torch.long, device=self_kv.device)
        self_kv[layer_ix, :, :, pos] = qkv[1:].permute(2, 0, 1, 3)
        att = _attend_prefix(qkv[0], self_kv[i, 0, :, :span], self_kv[i, 1, :, :span],
                             self_bias)
        x = _clamp_fp16(x + _linear(att, layer.o))
        h = _norm(x, layer.ln_cross, m.eps)
        att = _attend(_heads(m, _linear(h, layer.cq)), cross_kv[i, 0], cross_kv[i, 1],
                      cross_bias)
        x = _clamp_fp16(x + _linear(att, layer.co))
        x = _clamp_fp16(_ff(m, layer, x))
    x = _norm(x, m.dec_final, m.eps) * m.output_scale
    return _linear(x, m.lm_head)


def decode_greedy(m: LeanT5, tokens: torch.Tensor, pos: torch.Tensor, self_kv: torch.Tensor,
                  cross_kv: torch.Tensor, cross_bias: torch.Tensor, dec_bias: torch.Tensor
                  ) -> torch.Tensor:
    """Return the greedy next token [q] for each of the given positions (verification)."""
    logits = decode_logits(m, tokens, pos, self_kv, cross_kv, cross_bias, dec_bias)
    return logits[0].argmax(-1)


def decode_steps(m: LeanT5, token: torch.Tensor, pos: torch.Tensor, self_kv: torch.Tensor,
                 cross_kv: torch.Tensor, cross_bias: torch.Tensor, dec_bias: torch.Tensor,
                 steps: int) -> torch.Tensor:
    """Decode `steps` greedy tokens [steps] from token [1, 1] at position `pos` [1].

    One compiled call (one guard check, one host sync) covers several tokens; tokens
    after EOS are computed and dropped by the caller (their cache slots lie after the
    answer and are masked for it). The argmax feeds the next step inside the graph.
    """
    out = []
    for i in range(steps):
        logits = decode_logits(m, token, pos + i, self_kv, cross_kv, cross_bias, dec_bias)
        token = logits[0].argmax(-1).view(1, 1)
        out.append(token.view(1))
    return torch.cat(out)


def decode_rows(m: LeanT5, tokens: torch.Tensor, positions: torch.Tensor,
                caches: list[torch.Tensor], crosses: list[torch.Tensor],
                masks: list[torch.Tensor], dec_bias: torch.Tensor) -> torch.Tensor:
    """Decode one greedy step for B requests at once and return their tokens [B].

    Row r feeds tokens[r] at positions[r] into its own self-attention cache caches[r]
    (written there) and attends its own cross K/V crosses[r] under masks[r]: rows of
    different buckets and lengths share the step. The products run on all B rows (each
    weight read once per step); the attentions run per row. `dec_bias` is the full causal
    table [H, T, T] (ModelRunner.dec_bias). engine.native's `rows` computes the same in C.
    """
    b = int(tokens.shape[0])
    x = F.embedding(tokens.reshape(1, b), m.embed)  # the rows as one sequence: [1, B, D]
    where = [int(p) for p in positions.tolist()]
    for i, layer in enumerate(m.dec_layers):
        h = _norm(x, layer.ln_att, m.eps)
        qkv = _linear(h, layer.qkv).view(b, 3, m.n_heads, m.d_kv)
        atts = []
        for r, p in enumerate(where):
            kv = caches[r]
            kv[i, :, :, p] = qkv[r, 1:]
            keys = p + 1  # later slots are masked (weight exactly 0): not read
            atts.append(_attend_prefix(qkv[r, 0].unsqueeze(1), kv[i, 0, :, :keys],
                                       kv[i, 1, :, :keys], dec_bias[:, p:p + 1, :keys]))
        x = _clamp_fp16(x + _linear(torch.cat(atts, 1), layer.o), per_row=True)
        h = _norm(x, layer.ln_cross, m.eps)
        cq = _linear(h, layer.cq)
        atts = [_attend(_heads(m, cq[:, r:r + 1]), crosses[r][i, 0], crosses[r][i, 1], masks[r])
                for r in range(b)]
        x = _clamp_fp16(x + _linear(torch.cat(atts, 1), layer.co), per_row=True)
        x = _clamp_fp16(_ff(m, layer, x), per_row=True)
    x = _norm(x, m.dec_final, m.eps) * m.output_scale
    return _linear(x, m.lm_head)[0].argmax(-1)


def _attend_lanes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
                  ) -> torch.Tensor:
    # q [C, H, 1, d], k/v [C, H, keys, d], bias broadcast to [C, H, 1, keys]: one query per
    # lane, every lane's keys its own; out [1, C, H * d] (the lanes as one sequence).
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(1, q.shape[0], -1)


def decode_fixed(m: LeanT5, tokens: torch.Tensor, positions: torch.Tensor,
                 lanes: torch.Tensor, self_kv: torch.Tensor, cross_kv: torch.Tensor,
                 cross_bias: torch.Tensor, dec_bias: torch.Tensor) -> torch.Tensor:
    """Decode one greedy step for C lanes and return their tokens [C]: decode_rows with
    shapes that never depend on which rows are active or where they are.

    Lane c feeds tokens[c] at positions[c] into row lanes[c] of the rows' self-attention
    caches `self_kv` [R, L, 2, H, T + 1, d_kv] (written there), attends every slot of that
    row under the causal table `dec_bias` [H, T, T] (later slots weigh exactly 0), and
    attends the row's cross K/V `cross_kv` [R, L, 2, H, X, d_kv] (padded to X) under its
    mask bias `cross_bias` [R, 1, 1, X]. A lane no request fills points at a scratch row
    (engine.row_buffers): its writes land where no request reads, its token is dropped.
    No Python value is read from a tensor, so one graph serves every call of C lanes.
    """
    c = tokens.shape[0]
    slots = dec_bias.shape[-1]
    x = F.embedding(tokens.view(1, c), m.embed)  # the lanes as one sequence: [1, C, D]
    self_bias = dec_bias.index_select(1, positions).transpose(0, 1).unsqueeze(2)
    crosses = cross_kv.index_select(0, lanes)  # [C, L, 2, H, X, d_kv]
    cross_mask = cross_bias.index_select(0, lanes)  # [C, 1, 1, X]
    for i, layer in enumerate(m.dec_layers):
        h = _norm(x, layer.ln_att, m.eps)
        qkv = _linear(h, layer.qkv).view(c, 3, m.n_heads, m.d_kv)
        # Written into the cache tensor itself with tensor indices (the layer too, as in
        # decode_logits): an index_put_ on the base is done in place.
        layer_ix = torch.full((1,), i, dtype=torch.long, device=self_kv.device)
        self_kv[lanes, layer_ix, :, :, positions] = qkv[:, 1:]
        kv = self_kv[:, i, :, :, :slots].index_select(0, lanes)  # [C, 2, H, T, d_kv]
        att = _attend_lanes(qkv[:, 0].unsqueeze(2), kv[:, 0], kv[:, 1], self_bias)
        x = _clamp_fp16(x + _linear(att, layer.o), per_row=True)
        h = _norm(x, layer.ln_cross, m.eps)
        q = _linear(h, layer.cq).view(c, m.n_heads, 1, m.d_kv)
        att = _attend_lanes(q, crosses[:, i, 0], crosses[:, i, 1], cross_mask)
        x = _clamp_fp16(x + _linear(att, layer.co), per_row=True)
        x = _clamp_fp16(_ff(m, layer, x), per_row=True)
    x = _norm(x, m.dec_final, m.eps) * m.output_scale
    return _linear(x, m.lm_head)[0].argmax(-1)
