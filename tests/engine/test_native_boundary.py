"""The C step's boundary: each bad tensor is named and nothing is written; the library's build
cache keys on the compiler's version and every flag, and a library others could have
written is rebuilt, never loaded."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from engine import native
from engine.errors import BoundaryError, EngineError
from engine.protocol import FlagOverride
from engine.runtime import Runtime
from tests.engine.conftest import tiny_config

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def rt(tmp_path_factory, tiny_dirs) -> Runtime:
    cache = tmp_path_factory.mktemp("boundary") / "cache"
    runtime = Runtime(tiny_config(tiny_dirs, use_draft=False, compile_backend="eager",
                                  cache_dir=str(cache)))
    assert runtime.target.native is not None, runtime.step_kind
    return runtime


def _inputs(rt: Runtime) -> dict[str, object]:
    """Valid arguments of one direct step at position 3 (a random cache and cross K/V)."""
    r = rt.target
    m = r.m
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(m.new_self_cache(r.slots, static=False).shape, generator=gen)
    cross = torch.randn((len(m.dec_layers), 2, m.n_heads, 9, m.d_kv), generator=gen)
    mask = m.mask_bias(torch.ones((1, 9), dtype=torch.long))
    return dict(m=m, token=torch.tensor([[5]]), pos=r.positions[3], self_kv=cache,
                cross_kv=cross, mask_bias=mask, dec_bias=r.bias_for(4), steps=1)


def _bad_inputs(rt: Runtime) -> list[tuple[str, str, dict[str, object]]]:
    """(case, tensor named, changes to the valid step arguments)."""
    m, r = rt.target.m, rt.target
    ok = _inputs(rt)
    cache, cross, mask = ok["self_kv"], ok["cross_kv"], ok["mask_bias"]
    assert isinstance(cache, torch.Tensor) and isinstance(cross, torch.Tensor)
    assert isinstance(mask, torch.Tensor)
    span = r.bias_for(4).shape[-1]
    vocab = m.lm_head.shape[0]
    # The right shape, laid out transposed: written through its raw pointer, the wrong elements.
    strided = cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        ("cache float64", "self_kv", dict(self_kv=cache.double())),
        ("cache not contiguous", "self_kv", dict(self_kv=strided)),
        ("cache of another model", "self_kv", dict(self_kv=cache[:, :, :1].contiguous())),
        ("cross K/V float16", "cross_kv", dict(cross_kv=cross.half())),
        ("cross K/V of another d_kv", "cross_kv", dict(cross_kv=cross[..., :-1].contiguous())),
        ("mask float64", "mask_bias", dict(mask_bias=mask.double())),
        ("mask of another length", "mask_bias", dict(mask_bias=mask[..., :-1].contiguous())),
        ("bias of another head count", "dec_bias", dict(dec_bias=r.dec_bias[:1].contiguous())),
        ("bias not square", "dec_bias", dict(dec_bias=r.dec_bias[:, :4, :8].contiguous())),
        ("token float", "token", dict(token=torch.tensor([[5.0]]))),
        ("two tokens", "token", dict(token=torch.tensor([[5, 6]]))),
        ("token past the vocabulary", "token", dict(token=torch.tensor([[vocab]]))),
        ("negative token", "token", dict(token=torch.tensor([[-1]]))),
        ("position past the cache", "pos", dict(pos=torch.tensor([cache.shape[-2]]),
                                                dec_bias=r.dec_bias)),
        ("negative position", "pos", dict(pos=torch.tensor([-1]))),
        ("position past the bias span", "dec_bias", dict(pos=torch.tensor([span]))),
        # A round whose first steps fit but whose last does not: no step is written.
        ("round past the bias span", "dec_bias", dict(pos=torch.tensor([span - 2]), steps=4)),
        ("no steps", "steps", dict(steps=0)),
    ]


def test_each_bad_tensor_is_named_and_nothing_is_written(rt):
    fn = rt.target.native
    for case, name, changes in _bad_inputs(rt):
        args = {**_inputs(rt), **changes}
        watched = {k: v.clone() for k, v in args.items()
                   if k in ("self_kv", "cross_kv") and isinstance(v, torch.Tensor)}
        with pytest.raises(BoundaryError) as info:
            fn(*args.values())
        assert info.value.tensor == name, (case, str(info.value))
        assert isinstance(info.value, EngineError)
        assert str(info.value).startswith(f"native step: {name}: expected") or name in (
            "token", "pos", "dec_bias", "steps"), (case, str(info.value))
        for key, before in watched.items():
            after = args[key]
            assert isinstance(after, torch.Tensor)
            assert torch.equal(after, before), (case, key)
    # The valid arguments still decode (and write their position).
    args = _inputs(rt)
    before = args["self_kv"].clone()  # type: ignore[union-attr]
    fn(*args.values())
    assert not torch.equal(args["self_kv"], before)


def test_the_messages_say_what_was_expected(rt):
    fn = rt.target.native
    args = _inputs(rt)
    cases = {case: changes for case, _name, changes in _bad_inputs(rt)}
    said = {}
    for case in ("mask float64", "cache not contiguous", "token past the vocabulary",
                 "position past the cache", "cache of another model"):
        with pytest.raises(BoundaryError) as info:
            fn(*{**args, **cases[case]}.values())
        said[case] = str(info.value)
    assert said["mask float64"] == "native step: mask_bias: expected float32, got float64"
    assert "expected a contiguous tensor" in said["cache not contiguous"]
    m = rt.target.m
    assert said["token past the vocabulary"] == (
        f"native step: token: token id {m.lm_head.shape[0]} outside the vocabulary "
        f"[0, {m.lm_head.shape[0]})")
    assert "outside the cache's slots" in said["position past the cache"]
    assert f"expected shape [{len(m.dec_layers)}, 2, {m.n_heads}, slots, {m.d_kv}]" in \
        said["cache of another model"]


def test_a_bad_verification_is_named_and_writes_nothing(rt):
    r = rt.target
    fn = r.native
    args = _inputs(rt)
    q = r.verify_q
    vocab = r.m.lm_head.shape[0]
    base = (args["self_kv"], args["cross_kv"], args["mask_bias"], r.bias_for(20 + q))
    ids = list(range(5, 5 + q))
    for name, tokens, positions in (
            ("tokens", torch.tensor([[*ids[:-2], vocab + 3, ids[-1]]]), r.windows[20]),
            ("positions", torch.tensor([ids]), r.windows[20].flip(0)),
            ("positions", torch.tensor([ids]), r.windows[20].double()),
            ("tokens", torch.tensor([ids], dtype=torch.float32), r.windows[20])):
        before = args["self_kv"].clone()  # type: ignore[union-attr]
        with pytest.raises(BoundaryError) as info:
            fn.verify(r.m, tokens, positions, *base)
        assert info.value.tensor == name, str(info.value)
        assert torch.equal(args["self_kv"], before)


def test_a_request_is_checked_once(rt):
    """Its cache, cross K/V and mask in full at its first step; later steps by identity."""
    boundary = rt.target.native.boundary
    rt.warm_up(background=False)
    first = rt.generate("hello there", max_new_tokens=12,
                        override=FlagOverride(speculative=False))
    assert first.path == "compiled" and first.output_tokens > 1
    before = boundary.full_checks
    second = rt.generate("hello there", max_new_tokens=12,
                         override=FlagOverride(speculative=False))
    assert second.output_ids == first.output_ids
    # One new request (a new cross K/V and mask); the bias corners were seen by the first.
    assert boundary.full_checks == before + 1


# --- the batched step (tw_rows) ---------------------------------------------------------


def _rows_inputs(rt: Runtime) -> dict[str, object]:
    """Valid arguments of a batched step: three rows of different lengths and positions."""
    r = rt.target
    m = r.m
    gen = torch.Generator().manual_seed(2)
    caches, crosses, masks = [], [], []
    for length in (9, 16, 5):
        caches.append(torch.randn(m.new_self_cache(r.slots, static=False).shape, generator=gen))
        crosses.append(torch.randn((len(m.dec_layers), 2, m.n_heads, length, m.d_kv),
                                   generator=gen))
        masks.append(m.mask_bias(torch.ones((1, length), dtype=torch.long)))
    return dict(m=m, tokens=torch.tensor([5, 6, 7]), positions=torch.tensor([0, 3, 1]),
                caches=caches, crosses=crosses, masks=masks, dec_bias=r.dec_bias)


def _replace(seq: object, row: int, value: object) -> list[object]:
    assert isinstance(seq, list)
    return [value if i == row else t for i, t in enumerate(seq)]


def _bad_rows(rt: Runtime) -> list[tuple[str, str, dict[str, object]]]:
    """(case, argument named, changes to the valid batched step's arguments)."""
    r, m = rt.target, rt.target.m
    ok = _rows_inputs(rt)
    caches, crosses, masks = ok["caches"], ok["crosses"], ok["masks"]
    assert isinstance(caches, list) and isinstance(crosses, list) and isinstance(masks, list)
    vocab, slots = m.lm_head.shape[0], caches[2].shape[-2]
    strided = caches[1].transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        # Values only C sees: the rows before the bad one would be written if it checked late.
        ("row 1's token past the vocabulary", "tokens[1]",
         dict(tokens=torch.tensor([5, vocab, 7]))),
        ("row 2's token negative", "tokens[2]", dict(tokens=torch.tensor([5, 6, -1]))),
        ("row 2's position past its cache", "positions[2]",
         dict(positions=torch.tensor([0, 3, slots]))),
        ("row 0's position negative", "positions[0]", dict(positions=torch.tensor([-1, 3, 1]))),
        ("row 1's position past the bias span", "dec_bias",
         dict(positions=torch.tensor([0, 6, 1]), dec_bias=r.dec_bias[:, :4, :4].contiguous())),
        # Tensors, checked in Python once per request.
        ("row 2's cache float64", "caches[2]",
         dict(caches=_replace(caches, 2, caches[2].double()))),
        ("row 1's cache not contiguous", "caches[1]", dict(caches=_replace(caches, 1, strided))),
        ("row 1's cache of another slot count", "caches[1]",
         dict(caches=_replace(caches, 1, caches[1][:, :, :, :-1].contiguous()))),
        ("row 0's cross K/V of another d_kv", "crosses[0]",
         dict(crosses=_replace(crosses, 0, crosses[0][..., :-1].contiguous()))),
        ("row 1's mask float64", "masks[1]", dict(masks=_replace(masks, 1, masks[1].double()))),
        ("row 2's mask of another length", "masks[2]",
         dict(masks=_replace(masks, 2, masks[2][..., :-1].contiguous()))),
        ("a mask missing", "masks", dict(masks=masks[:2])),
        ("tokens float", "tokens", dict(tokens=torch.tensor([5.0, 6.0, 7.0]))),
        ("a position missing", "positions", dict(positions=torch.tensor([0, 3]))),
        ("bias of another head count", "dec_bias", dict(dec_bias=r.dec_bias[:1].contiguous())),
    ]


def test_a_bad_row_is_named_and_no_row_is_written(rt):
    fn = rt.target.native
    for case, name, changes in _bad_rows(rt):
        args = {**_rows_inputs(rt), **changes}
        caches = args["caches"]
        assert isinstance(caches, list)
        before = [c.clone() for c in caches]
        with pytest.raises(BoundaryError) as info:
            fn.rows(*args.values())
        assert info.value.tensor == name, (case, str(info.value))
        assert isinstance(info.value, EngineError)
        for row, (after, was) in enumerate(zip(caches, before, strict=True)):
            assert torch.equal(after, was), (case, row)
    # The valid rows still decode, each writing its own cache.
    args = _rows_inputs(rt)
    caches = args["caches"]
    assert isinstance(caches, list)
    before = [c.clone() for c in caches]
    fn.rows(*args.values())
    assert all(not torch.equal(c, b) for c, b in zip(caches, before, strict=True))


def test_the_rows_messages_name_the_row_and_what_was_expected(rt):
    fn, m = rt.target.native, rt.target.m
    slots = m.new_self_cache(rt.target.slots, static=False).shape[-2]
    said = {}
    for case, _name, changes in _bad_rows(rt):
        with pytest.raises(BoundaryError) as info:
            fn.rows(*{**_rows_inputs(rt), **changes}.values())
        said[case] = str(info.value)
    vocab = m.lm_head.shape[0]
    assert said["row 1's token past the vocabulary"] == (
        f"native step: tokens[1]: token id {vocab} outside the vocabulary [0, {vocab})")
    assert said["row 2's position past its cache"] == (
        f"native step: positions[2]: position {slots} outside the cache's slots [0, {slots})")
    assert said["row 1's position past the bias span"] == (
        "native step: dec_bias: span 4 does not cover row 1's position 6")
    assert said["row 1's mask float64"] == "native step: masks[1]: expected float32, got float64"
    assert said["row 1's cache of another slot count"] == (
        f"native step: caches[1]: expected {slots} slots (row 0's), got {slots - 1}")


def test_a_batched_row_is_checked_once_per_request(rt):
    """Each row's tensors in full at its request's first step; later steps by identity."""
    fn = rt.target.native
    args = _rows_inputs(rt)
    fn.rows(*args.values())
    before = fn.boundary.full_checks
    for step in range(1, 4):
        fn.rows(*{**args, "positions": torch.tensor([step, 3 + step, 1 + step])}.values())
    assert fn.boundary.full_checks == before
    # Row 1 is another request now (its own cross K/V and mask): that row alone is checked.
    crosses, masks = args["crosses"], args["masks"]
    assert isinstance(crosses, list) and isinstance(masks, list)
    args["crosses"] = _replace(crosses, 1, crosses[1].clone())
    args["masks"] = _replace(masks, 1, masks[1].clone())
    fn.rows(*args.values())
    assert fn.boundary.full_checks == before + 1


# --- the build ------------------------------------------------------------------------


def _fake_cc(tmp_path: Path, version: str) -> tuple[Path, Path, Path]:
    """A compiler that says `version` (from a file) and counts its builds."""
    version_file, builds = tmp_path / "cc-version", tmp_path / "cc-builds"
    version_file.write_text(version)
    cc = tmp_path / "fake-cc"
    cc.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then cat {version_file}; exit 0; fi\n'
                  f'echo build >> {builds}\nexec {native._compiler()} "$@"\n')
    cc.chmod(0o755)
    return cc, version_file, builds


def _builds(builds: Path) -> int:
    return len(builds.read_text().splitlines()) if builds.exists() else 0


def test_rebuilt_when_the_compiler_version_or_a_flag_changes(tmp_path, monkeypatch):
    cc, version, builds = _fake_cc(tmp_path, "gcc (Fake) 12.2.0\n")
    monkeypatch.setenv("CC", str(cc))
    cache = tmp_path / "cache"
    first = native.build(cache)
    assert first is not None and first.is_file() and _builds(builds) == 1
    assert native.build(cache) == first and _builds(builds) == 1  # cached: not rebuilt

    version.write_text("gcc (Fake) 14.1.0\n")  # the same path, upgraded
    upgraded = native.build(cache)
    assert upgraded is not None and upgraded != first and _builds(builds) == 2

    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DTW_ANOTHER_FLAG=1"))
    flagged = native.build(cache)
    assert flagged is not None and flagged not in (first, upgraded) and _builds(builds) == 3
    assert native.NativeStep(flagged)._fn is not None  # a loadable library


def test_the_cache_folder_is_created_owner_only(tmp_path):
    native.build(tmp_path / "cache")
    assert stat.S_IMODE((tmp_path / "cache" / "native").stat().st_mode) == 0o700
    loose = tmp_path / "loose" / "native"
    loose.mkdir(parents=True)
    loose.chmod(0o777)
    native.build(tmp_path / "loose")
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_a_library_writable_by_others_is_rebuilt_never_loaded(tmp_path, monkeypatch, caplog):
    cc, _version, builds = _fake_cc(tmp_path, "gcc (Fake) 12.2.0\n")
    monkeypatch.setenv("CC", str(cc))
    cache = tmp_path / "cache"
    path = native.build(cache)
    assert path is not None and _builds(builds) == 1
    # Planted: not a library at all (loading it would fail), and writable by anyone.
    path.write_bytes(b"planted")
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        lib = native.load(cache)
    assert lib is not None and lib.path == path and _builds(builds) == 2
    assert path.read_bytes() != b"planted" and stat.S_IMODE(path.stat().st_mode) == 0o755
    assert any("refused (writable by group or others (mode 666))" in r.getMessage()
               for r in caplog.records)
    # Group-writable alone is refused too; a link is replaced by a file of this user's.
    path.chmod(0o775)
    assert native.build(cache) == path and _builds(builds) == 3
    elsewhere = tmp_path / "elsewhere.so"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    assert native.build(cache) == path and _builds(builds) == 4 and not path.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_library_or_folder_of_another_user_is_not_loaded(tmp_path, monkeypatch, caplog):
    cc, _version, builds = _fake_cc(tmp_path, "gcc (Fake) 12.2.0\n")
    monkeypatch.setenv("CC", str(cc))
    cache = tmp_path / "cache"
    path = native.build(cache)
    assert path is not None
    os.chown(path, 65534, 65534)
    assert native.build(cache) == path and _builds(builds) == 2
    assert path.stat().st_uid == os.geteuid()
    # A folder that is not this user's: nothing in it is used, the compiled step serves.
    os.chown(cache / "native", 65534, 65534)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        assert native.load(cache) is None
    assert _builds(builds) == 2
    assert [r.getMessage() for r in caplog.records if r.name == "engine.native"] == [
        f"native step: {cache / 'native'} is owned by uid 65534, not this service's uid "
        f"{os.geteuid()}: not used; the compiled step serves instead"]


def test_a_build_failure_is_logged_once(tmp_path, monkeypatch, caplog):
    cc = tmp_path / "broken-cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo broken 1.0; exit 0; fi\n'
                  'echo "broken-cc: internal error" >&2\nexit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        assert native.load(tmp_path / "cache") is None
        assert native.load(tmp_path / "cache") is None
    said = [r.getMessage() for r in caplog.records if r.name == "engine.native"]
    assert said == ["native step: build failed (broken-cc: internal error); the compiled step "
                    "serves instead"]


def test_the_tests_compiler_cache_builds_once_per_source_and_flags(tmp_path, monkeypatch):
    # tests/utils/cached_cc.sh: engines in other cache folders get a copy of the one build.
    if "TW_REAL_CC" not in os.environ:
        pytest.skip("no C compiler: the tests' compiler cache is off")
    log = tmp_path / "real-builds"
    real = tmp_path / "counting-cc"
    real.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] || echo build >> {log}\n'
                    f'exec {os.environ["TW_REAL_CC"]} "$@"\n')
    real.chmod(0o755)
    monkeypatch.setenv("TW_REAL_CC", str(real))
    monkeypatch.setenv("TW_CC_CACHE", str(tmp_path / "cc-cache"))
    first, second = native.build(tmp_path / "a"), native.build(tmp_path / "b")
    assert first is not None and second is not None and first != second
    assert _builds(log) == 1 and second.read_bytes() == first.read_bytes()
    assert stat.S_IMODE(second.stat().st_mode) == 0o755
    assert native.NativeStep(second)._fn is not None
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DTW_ANOTHER_FLAG=1"))
    assert native.build(tmp_path / "c") is not None and _builds(log) == 2
