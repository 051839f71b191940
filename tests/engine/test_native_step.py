"""The C decode step (engine.native): the torch step's tokens and cache, or a clean fallback."""

from __future__ import annotations

import pytest
import torch

from engine import native, t5
from engine.protocol import FlagOverride
from engine.runtime import Runtime
from tests.engine.conftest import build_tiny_t5, limit_isa, random_texts, tiny_config

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


def _runtime(tmp_path, model_dir, **changes) -> Runtime:
    return Runtime(tiny_config({"target": model_dir, "draft": model_dir}, use_draft=False,
                               compile_backend="eager", cache_dir=str(tmp_path / "cache"),
                               **changes))


# d_model 20 and 18: rows and lengths that are no multiple of the vector width (the scalar
# tails). "sse": built without AVX, so the 4-float width is tested on any x86 machine;
# "avx2": built without AVX-512, the 8-float width on any AVX2 machine (the machine's own
# width is "native").


@pytest.mark.parametrize(("d_model", "isa"), [(32, "native"), (20, "native"), (18, "sse"),
                                              (20, "avx2")])
def test_native_step_writes_the_same_cache_and_picks_the_same_token(
        tmp_path, monkeypatch, d_model, isa):
    limit_isa(tmp_path, monkeypatch, isa)
    model = build_tiny_t5(tmp_path / "m", seed=3, d_model=d_model, heads=2)
    rt = _runtime(tmp_path, model)
    assert rt.step_kind == "target native" and rt.info.decode_step == "target native"
    r = rt.target
    m = r.m
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(m.new_self_cache(r.slots).shape, generator=gen)
    cache_native = cache.clone()
    length = 11
    cross = torch.randn((len(m.dec_layers), 2, m.n_heads, length, m.d_kv), generator=gen)
    keep = torch.ones((1, length), dtype=torch.long)
    keep[0, -3:] = 0  # bucket padding: masked in the cross-attention
    mask = m.mask_bias(keep)
    picked = []
    for pos, token in ((0, 0), (5, 40), (17, 77), (r.slots - 1, 100)):
        tok, at, bias = torch.tensor([[token]]), r.positions[pos], r.bias_for(pos + 1)
        with torch.no_grad():
            want = t5.decode_steps(m, tok, at, cache, cross, mask, bias, 1)
            got = r.native(m, tok, at, cache_native, cross, mask, bias, 1)
        assert got.tolist() == want.tolist(), pos
        picked.append(got.item())
        # The same K/V written at `pos`, and nothing else touched.
        torch.testing.assert_close(cache_native, cache, rtol=1e-5, atol=1e-5)
    assert len(set(picked)) > 1  # the inputs steer the token: not a constant

    # Several steps in one call (a draft's round): the tokens and the cache of one call per
    # step, each step's choice fed to the next.
    chained, single = cache_native.clone(), cache_native.clone()
    tok, singles = torch.tensor([[7]]), []
    with torch.no_grad():
        got = r.native(m, tok, r.positions[30], chained, cross, mask, r.bias_for(34), 4)
        for i in range(4):
            singles.append(r.native(m, tok, r.positions[30 + i], single, cross, mask,
                                    r.bias_for(31 + i), 1).item())
            tok = torch.tensor([[singles[-1]]])
    assert got.tolist() == singles
    assert torch.equal(chained, single) and not torch.equal(chained, cache_native)

    # A verification of q consecutive positions: torch's choices and K/V, and bitwise the
    # tokens of the same rows decoded one at a time (speculation stays exact).
    q = r.verify_q
    toks = torch.tensor([[5, 60, 61, 62, 63, 64, 65, 66, 67][:q]])
    at, bias = r.windows[20], r.bias_for(20 + q)
    one_by_one = cache_native.clone()
    with torch.no_grad():
        want = t5.decode_greedy(m, toks, at, cache, cross, mask, bias)
        got = r.native.verify(m, toks, at, cache_native, cross, mask, bias)
        alone = [r.native(m, toks[:, i:i + 1], r.positions[20 + i], one_by_one, cross, mask,
                          bias, 1).item() for i in range(q)]
    assert got.tolist() == want.tolist() == alone
    torch.testing.assert_close(cache_native, cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(one_by_one, cache_native)


def test_served_requests_equal_the_eager_path(tmp_path, tiny_dirs):
    rt = Runtime(tiny_config(tiny_dirs, compile_backend="eager",
                             cache_dir=str(tmp_path / "cache")))
    rt.warm_up(background=False)
    assert rt.step_kind == "target native, draft native"
    for text in random_texts(24, seed=9):
        plain = rt.generate(text, max_new_tokens=16, override=FlagOverride(
            speculative=False, compiled=False))
        for spec in (False, True):  # the draft's steps and the verification in C too
            fast = rt.generate(text, max_new_tokens=16, override=FlagOverride(speculative=spec))
            assert fast.path in ("compiled", "overflow")
            assert fast.output_ids == plain.output_ids, (text, spec)


def test_without_a_compiler_the_compiled_step_serves(tmp_path, tiny_dirs, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    (tmp_path / "no-such-compiler").write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    (tmp_path / "no-such-compiler").chmod(0o755)
    rt = _runtime(tmp_path, tiny_dirs["target"])
    assert rt.target.native is None
    assert rt.step_kind.startswith("compiled (no C compiler"), rt.step_kind
    rt.warm_up(background=False)
    out = rt.generate("hello there", max_new_tokens=8, override=FlagOverride(speculative=False))
    assert out.path == "compiled" and out.output_ids


def test_native_step_off_keeps_the_compiled_step_and_int8_runs_in_c(tmp_path, tiny_dirs):
    off = _runtime(tmp_path, tiny_dirs["target"], native_step=False)
    assert off.target.native is None and off.step_kind == "compiled (native_step off)"
    assert off.info.config_hash != _runtime(tmp_path, tiny_dirs["target"]).info.config_hash
    q = _runtime(tmp_path, tiny_dirs["target"], quantization="int8")
    assert q.target.native is not None
    assert q.target_q is not None and q.target_q.native is not None  # int8 weights in C
    assert q.step_kind == "target native, target-int8 native"
