"""Built-in models: the draft agrees in-domain and disagrees on shifted text."""

from __future__ import annotations

import pytest

from engine.config import BUILTIN_DIR, EngineConfig
from engine.protocol import FlagOverride

pytestmark = pytest.mark.skipif(
    not (BUILTIN_DIR / "target" / "config.json").is_file()
    or not (BUILTIN_DIR / "draft" / "config.json").is_file(),
    reason="built-in models not trained yet (engine/builtin/target, engine/builtin/draft)")


@pytest.fixture(scope="module")
def builtin_engine():
    from engine import load_engine

    engine = load_engine(EngineConfig(compile_mode="off"))
    yield engine
    engine.close()


def _bucket_acceptance(engine, domain: str, per_bucket: int = 3) -> dict[str, float]:
    lines = (BUILTIN_DIR / "canaries" / f"{domain}.txt").read_text().splitlines()
    counts: dict[str, list[int]] = {}
    for text in (line for line in lines if line.strip()):
        bucket = engine.bucket_for(engine.count_tokens(text))
        acc = counts.setdefault(bucket, [0, 0, 0])
        if acc[2] >= per_bucket:
            continue
        r = engine.generate(text, max_new_tokens=48, override=FlagOverride(speculative=True))
        acc[0] += r.spec.accepted_tokens
        acc[1] += r.spec.draft_tokens
        acc[2] += 1
    return {b: a / p for b, (a, p, _) in counts.items() if p}


def test_acceptance_in_domain_vs_shifted(builtin_engine):
    in_domain = _bucket_acceptance(builtin_engine, "in_domain")
    shifted = _bucket_acceptance(builtin_engine, "shifted")
    assert len(in_domain) >= 3 and len(shifted) >= 3
    mean_in = sum(in_domain.values()) / len(in_domain)
    mean_shift = sum(shifted.values()) / len(shifted)
    assert mean_in >= 0.7, in_domain
    assert mean_shift <= 0.5, shifted


def test_builtin_speculative_matches_direct(builtin_engine):
    lines = (BUILTIN_DIR / "canaries" / "shifted.txt").read_text().splitlines()[:6]
    for text in lines:
        a = builtin_engine.generate(text, max_new_tokens=48, override=FlagOverride(speculative=False))
        b = builtin_engine.generate(text, max_new_tokens=48, override=FlagOverride(speculative=True))
        assert a.output_ids == b.output_ids
