"""Speculative decoding emits exactly the target's greedy tokens and counts like vLLM."""

from __future__ import annotations

from engine.protocol import DECODING_DIRECT, DECODING_SPECULATIVE, FlagOverride
from tests.engine.conftest import BUCKETS, random_texts

MAX_NEW = 20


def test_speculative_identical_to_direct_greedy(warm_engine, flags):
    texts = random_texts(200, seed=3)
    totals = {"drafts": 0, "proposed": 0, "accepted": 0}
    buckets = set()
    for text in texts:
        direct = warm_engine.generate(text, max_new_tokens=MAX_NEW,
                                      override=FlagOverride(speculative=False))
        spec = warm_engine.generate(text, max_new_tokens=MAX_NEW,
                                    override=FlagOverride(speculative=True))
        assert direct.decoding == DECODING_DIRECT and spec.decoding == DECODING_SPECULATIVE
        assert spec.output_ids == direct.output_ids, text
        assert spec.path == direct.path
        s = spec.spec
        # The draft length is chosen per bucket from the measured acceptance and costs.
        assert 1 <= spec.spec_k <= warm_engine.k_max and direct.spec_k == 0
        assert s.draft_tokens == spec.spec_k * s.drafts
        assert len(s.accepted_per_position) == spec.spec_k
        assert s.accepted_tokens == sum(s.accepted_per_position)
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
        assert s.target_forwards == s.drafts
        # Every round emits its accepted tokens plus one (the last round may be cut short).
        assert spec.output_tokens <= s.accepted_tokens + s.drafts
        assert len(spec.decode_token_s) == spec.output_tokens - 1
        totals["drafts"] += s.drafts
        totals["proposed"] += s.draft_tokens
        totals["accepted"] += s.accepted_tokens
        buckets.add(spec.bucket)
    assert buckets == {*map(str, BUCKETS), "overflow"}
    rate = totals["accepted"] / totals["proposed"]
    # The noisy draft agrees often but not always: both acceptance and rollback ran.
    assert 0.1 < rate < 0.95, rate


def test_unrelated_draft_still_exact(tiny_dirs):
    """A draft that almost never agrees (different weights, smaller) changes only speed."""
    from engine import load_engine
    from tests.engine.conftest import tiny_config

    engine = load_engine(tiny_config(tiny_dirs, draft_dir=str(tiny_dirs["other"]),
                                     compile_mode="off", speculative_k=4))
    try:
        for text in random_texts(20, seed=4):
            a = engine.generate(text, max_new_tokens=MAX_NEW, override=FlagOverride(speculative=False))
            b = engine.generate(text, max_new_tokens=MAX_NEW, override=FlagOverride(speculative=True))
            assert a.output_ids == b.output_ids
            assert b.spec.drafts > 0
    finally:
        engine.close()
