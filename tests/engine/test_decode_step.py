"""The decode step: HF-exact in every bucket, static mutated inputs, honest timestamps, any k."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine import decoding, t5
from engine.compile_watch import specialize
from engine.protocol import PATH_COMPILED, FlagOverride
from engine.runner import Fns
from tests.engine.conftest import BUCKETS, random_texts, tiny_config

MAX_NEW = 16


@pytest.fixture(scope="module")
def eager_engine(tiny_dirs):
    from engine import load_engine

    engine = load_engine(tiny_config(tiny_dirs, compile_mode="off"))
    yield engine
    engine.close()


def _bucket_texts(per_bucket: int, seed: int) -> dict[int, list[str]]:
    """Return `per_bucket` ASCII texts for each bucket (ByT5: one token per byte + EOS)."""
    rng = random.Random(seed)
    out: dict[int, list[str]] = {}
    lo = 2
    for edge in BUCKETS:
        out[edge] = ["x" + "".join(rng.choice("abcdefghij klmnop")
                                   for _ in range(rng.randint(lo, edge) - 3)) + "x"
                     for _ in range(per_bucket)]
        lo = edge + 1
    return out


def test_compiled_step_equals_hf_on_50_inputs_per_bucket(warm_engine, flags):
    from transformers import T5ForConditionalGeneration

    hf = T5ForConditionalGeneration.from_pretrained(warm_engine.config.model_dir).eval()
    for edge, texts in _bucket_texts(50, seed=11).items():
        for text in texts:
            r = warm_engine.generate(text, max_new_tokens=MAX_NEW,
                                     override=FlagOverride(speculative=False))
            assert r.path == PATH_COMPILED and r.bucket == str(edge)
            ids = torch.tensor([warm_engine.tokenizer(text).input_ids])
            with torch.no_grad():
                ref = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
            assert list(r.output_ids) == ref[0].tolist()[1:], text


def test_mutated_step_inputs_are_static(tiny_dirs, eager_engine):
    """Every input the compiled step writes is marked static (CUDA graphs can capture it)."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    runner = eager_engine.target
    m = runner.m
    step = torch.compile(specialize(t5.decode_steps, "static_check"), backend=backend,
                         dynamic=False, fullgraph=True)
    with torch.no_grad():
        ids = torch.full((1, 8), m.eos_id, dtype=torch.long)
        mask = m.mask_bias(torch.ones((1, 8), dtype=torch.long))
        cross = t5.encode(m, ids, mask, runner.encoder_bias(8))
        kv = m.new_self_cache(runner.slots)
        step(m, runner.start, runner.positions[0], kv, cross, mask, runner.dec_bias, 1)
        (gm, inputs), = captured
        mutated = []
        for i, original in enumerate(inputs):
            if not isinstance(original, torch.Tensor) or not original.is_floating_point():
                continue
            clones = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            clones[i].normal_()  # noise: a write of the step's values shows as a change
            before = clones[i].clone()
            gm(*clones)
            if not torch.equal(clones[i], before):
                mutated.append(original)
    assert mutated, "the step writes its KV cache in place"
    assert any(t is kv for t in mutated)
    for t in mutated:
        assert getattr(t, "_dynamo_static_input_type", None) is not None, tuple(t.shape)


def _prepared(engine, text: str):
    tokens = engine.tokenizer(text).input_ids
    ids = torch.tensor([tokens])
    mask = torch.ones_like(ids)
    tenc = decoding.encode(engine.target, engine.target.eager, ids, mask)
    denc = decoding.encode(engine.draft, engine.draft.eager, ids, mask)
    return tenc, denc


def test_speculative_ttft_is_after_the_first_verification(eager_engine):
    """No token is confirmed before the target verified it: stamps come after verify ends."""
    ticks = itertools.count()
    clock = lambda: float(next(ticks))  # noqa: E731 - a fake clock that only moves forward
    verify_ends: list[float] = []
    real = eager_engine.target.eager

    def verify(*args):
        out = real.verify(*args)
        verify_ends.append(clock())
        return out

    fns = Fns(real.encode, real.step, verify)
    caches = eager_engine.rows.caches[0]
    with torch.no_grad():
        tenc, denc = _prepared(eager_engine, "xabc defx")
        out = decoding.speculative(eager_engine.target, fns, tenc, caches["target"],
                                   eager_engine.draft, eager_engine.draft.eager, denc,
                                   caches["draft"], 3, MAX_NEW, clock=clock)
    assert len(verify_ends) == out.spec.drafts >= 1
    assert out.stamps[0] >= verify_ends[0]
    # Tokens of one round share its confirmation time; rounds are ordered.
    assert set(out.stamps) <= {t + 1 for t in verify_ends}
    assert out.stamps == sorted(out.stamps)


def test_generate_stamps_tokens_by_round(eager_engine):
    r = eager_engine.generate("xabcdefx", max_new_tokens=MAX_NEW,
                              override=FlagOverride(speculative=True))
    assert r.spec.drafts >= 1 and r.spec_k >= 1 and r.ttft_s > r.encoder_s
    # Tokens of one round share its confirmation time: each round adds (tokens - 1) zero
    # gaps, and the gap into a new round is that round's time.
    assert sum(d == 0.0 for d in r.decode_token_s) == r.output_tokens - r.spec.drafts


@pytest.mark.parametrize("seed", [21, 22])
def test_every_draft_length_gives_the_direct_output(eager_engine, seed):
    """Adaptive k only changes speed: every k in 1..k_max emits the target's greedy tokens."""
    caches = eager_engine.rows.caches[0]
    target, draft = eager_engine.target, eager_engine.draft
    for text in random_texts(6, seed=seed, overflow=False):
        with torch.no_grad():
            tenc, denc = _prepared(eager_engine, text)
            ref = decoding.direct(target, target.eager, tenc, caches["target"], MAX_NEW)
            for k in range(1, eager_engine.k_max + 1):
                out = decoding.speculative(target, target.eager, tenc, caches["target"],
                                           draft, draft.eager, denc, caches["draft"], k,
                                           MAX_NEW)
                assert out.tokens == ref.tokens, (text, k)
                assert out.spec.draft_tokens == k * out.spec.drafts
    with pytest.raises(ValueError, match="k: must be between 1"):
        decoding.speculative(target, target.eager, tenc, caches["target"], draft, draft.eager,
                             denc, caches["draft"], eager_engine.k_max + 1, MAX_NEW)
