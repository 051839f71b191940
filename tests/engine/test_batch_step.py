"""The B-row decode step: each row's token and K/V are what the row gets decoded alone."""

from __future__ import annotations

import pytest
import torch

from engine import native, t5
from engine.errors import BoundaryError
from engine.runtime import Runtime
from tests.engine.conftest import build_tiny_t5, tiny_config


def _rows(r, gen, lengths):
    """Return per-row caches, cross K/V and masks: different buckets, some padding."""
    m = r.m
    caches, crosses, masks = [], [], []
    for length in lengths:
        caches.append(torch.randn(m.new_self_cache(r.slots, static=False).shape,
                                  generator=gen))
        crosses.append(torch.randn((len(m.dec_layers), 2, m.n_heads, length, m.d_kv),
                                   generator=gen))
        keep = torch.ones((1, length), dtype=torch.long)
        keep[0, length - length // 4:] = 0  # bucket padding, masked
        masks.append(m.mask_bias(keep))
    return caches, crosses, masks


def _c_target(tmp_path):
    """Return the C step's target runner of a tiny model (its widths no vector multiple)."""
    if native._compiler() is None:
        pytest.skip("no C compiler")
    model = build_tiny_t5(tmp_path / "m", seed=5, d_model=20, heads=2)
    rt = Runtime(tiny_config({"target": model, "draft": model}, use_draft=False,
                             compile_backend="eager", cache_dir=str(tmp_path / "cache")))
    return rt.target


@pytest.mark.parametrize("use_native", [True, False])
def test_rows_of_mixed_buckets_and_positions_equal_each_row_alone(tmp_path, use_native):
    if use_native and native._compiler() is None:
        pytest.skip("no C compiler")
    model = build_tiny_t5(tmp_path / "m", seed=5, d_model=20, heads=2)
    rt = Runtime(tiny_config({"target": model, "draft": model}, use_draft=False,
                             compile_backend="eager", cache_dir=str(tmp_path / "cache"),
                             native_step=use_native))
    r = rt.target
    assert (r.native is not None) == use_native
    m = r.m
    gen = torch.Generator().manual_seed(1)
    lengths, where = [8, 16, 11, 32, 8], [0, 7, 33, 5, r.slots - 1]
    caches, crosses, masks = _rows(r, gen, lengths)
    alone_caches = [c.clone() for c in caches]
    tokens = torch.tensor([0, 40, 77, 3, 100])
    positions = torch.tensor(where)
    step = r.native.rows if use_native else t5.decode_rows
    with torch.no_grad():
        got = step(m, tokens, positions, caches, crosses, masks, r.dec_bias)
        alone = [(r.native or t5.decode_steps)(
            m, tokens[i].view(1, 1), r.positions[p], alone_caches[i], crosses[i], masks[i],
            r.bias_for(p + 1), 1).item() for i, p in enumerate(where)]
    assert got.tolist() == alone
    assert len(set(alone)) > 1  # the rows steer their tokens
    for batched, single in zip(caches, alone_caches, strict=True):
        if use_native:
            assert torch.equal(batched, single)  # bitwise: the same sums per row
        else:
            torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


def test_bucket_padding_keys_are_never_read_by_the_c_step(tmp_path):
    # The C step skips the trailing masked (padding) keys of each row's cross-attention, the
    # bulk of a batched step's memory traffic: their weight is exactly 0, so skipping them
    # changes no bit. NaN written into the padding's K/V shows they are not read at all.
    r = _c_target(tmp_path)
    m = r.m
    gen = torch.Generator().manual_seed(3)
    lengths, where = [16, 32, 8], [0, 9, 4]
    caches, crosses, masks = _rows(r, gen, lengths)
    poisoned = [c.clone() for c in crosses]
    for cross, length in zip(poisoned, lengths, strict=True):
        cross[..., length - length // 4:, :] = float("nan")  # the masked padding's K/V
    tokens, positions = torch.tensor([5, 40, 77]), torch.tensor(where)
    clean = torch.empty((3, r.native.vocab))
    dirty = torch.empty((3, r.native.vocab))
    with torch.no_grad():
        want = r.native.rows(m, tokens, positions, [c.clone() for c in caches], crosses,
                             masks, r.dec_bias, logits=clean)
        got = r.native.rows(m, tokens, positions, caches, poisoned, masks, r.dec_bias,
                            logits=dirty)
    assert got.tolist() == want.tolist()
    assert torch.equal(dirty, clean)  # bitwise, NaN-free


def test_a_requests_positions_attend_together_and_stay_each_position_alone(tmp_path):
    # Consecutive rows on one cache (a verification's positions) attend it together, up to
    # engine/native_step.c's ATT_ROWS at a time: ten positions of one request (more than one
    # group), split by another request's row, are bitwise the positions decoded one by one.
    r = _c_target(tmp_path)
    m = r.m
    gen = torch.Generator().manual_seed(7)
    (cache_a, cache_b), (cross_a, cross_b), (mask_a, mask_b) = _rows(r, gen, [16, 8])
    start, n = 3, 10
    assert native.load(tmp_path / "cache").att_rows < n <= r.slots - start
    where = [*range(start, start + 6), 12, *range(start + 6, start + n)]
    owners = ["a"] * 6 + ["b"] + ["a"] * (n - 6)
    tokens = torch.randint(3, m.vocab_size, (len(where),), generator=gen)
    caches = {"a": cache_a, "b": cache_b}
    alone_caches = {k: c.clone() for k, c in caches.items()}
    crosses, masks = {"a": cross_a, "b": cross_b}, {"a": mask_a, "b": mask_b}
    together = torch.empty((len(where), r.native.vocab))
    one = torch.empty((1, r.native.vocab))
    with torch.no_grad():
        got = r.native.rows(m, tokens, torch.tensor(where), [caches[o] for o in owners],
                            [crosses[o] for o in owners], [masks[o] for o in owners],
                            r.dec_bias, logits=together)
        for i, (owner, p) in enumerate(zip(owners, where, strict=True)):
            alone = r.native.rows(m, tokens[i:i + 1], torch.tensor([p]),
                                  [alone_caches[owner]], [crosses[owner]], [masks[owner]],
                                  r.dec_bias, logits=one)
            assert alone.item() == got[i].item()
            assert torch.equal(one[0], together[i]), (owner, p)
    for owner in caches:
        assert torch.equal(caches[owner], alone_caches[owner])


def test_the_products_alone_give_each_input_its_own_sums(tmp_path):
    # tw_gemm (bench.batch_step's products alone) runs the step's own kernel: an input's
    # outputs are bitwise the same alone or among 7 (its 4-, 2- and 1-input blockings, at
    # widths no vector multiple) or among enough to be split into chunks (a full batch's
    # verification: 70 inputs of 192 and 41 of 520 pass in several), and x w^T within
    # float rounding.
    if native._compiler() is None:
        pytest.skip("no C compiler")
    lib = native.load(tmp_path / "cache")
    assert lib is not None
    gen = torch.Generator().manual_seed(3)
    for rows, n, inputs in ((7, 20, 7), (37, 50, 7), (64, 48, 7), (9, 192, 70), (6, 520, 41)):
        w = torch.randn(rows, n, generator=gen)
        x = torch.randn(inputs, n, generator=gen)
        together = lib.products(x, w)
        torch.testing.assert_close(together, x @ w.t(), rtol=1e-5, atol=1e-4)
        for i in range(inputs):
            assert torch.equal(lib.products(x[i:i + 1].contiguous(), w)[0], together[i])
    with pytest.raises(BoundaryError, match="native step: w: "):
        lib.products(torch.randn(2, 20), torch.randn(5, 21))
