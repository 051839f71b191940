"""The adaptive draft length: k from measured acceptance and costs, direct when it cannot pay."""

from __future__ import annotations

import pytest

from engine.draft_length import DraftLength, expected_tokens
from engine.protocol import SpecStats


def _spec(drafts: int, k: int, accept_first: int) -> SpecStats:
    """Rounds where every proposal is accepted in `accept_first` rounds, none in the rest."""
    per = tuple([accept_first] * k)
    return SpecStats(drafts=drafts, draft_tokens=k * drafts, accepted_tokens=accept_first * k,
                     accepted_per_position=per, target_forwards=drafts)


def _feed(dl: DraftLength, bucket: str, spec: SpecStats, *, draft_s: float, verify_s: float,
          step_s: float, times: int = 20) -> None:
    for _ in range(times):
        dl.record_speculative(bucket, spec, draft_steps=spec.draft_tokens,
                              draft_s=draft_s * spec.draft_tokens, verifies=spec.drafts,
                              verify_s=verify_s * spec.drafts)
        dl.record_direct(bucket, 10, step_s * 10)


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_initial_k_until_measured():
    dl = DraftLength(k_max=8, k_initial=4)
    assert dl.choose("32") == 4
    assert dl.view()["32"].acceptance is None


def test_high_acceptance_and_cheap_draft_picks_a_long_draft():
    dl = DraftLength(k_max=8, k_initial=4)
    _feed(dl, "32", _spec(10, 4, accept_first=10), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    view = dl.view()["32"]
    assert view.acceptance == pytest.approx(1.0) and view.k == 8 and not view.fallback
    assert dl.choose("32") == 8
    assert view.expected_speedup > 3


def test_low_acceptance_falls_back_to_direct_and_keeps_probing():
    dl = DraftLength(k_max=8, k_initial=4, probe_every=4, max_probe_every=16)
    _feed(dl, "64", _spec(10, 4, accept_first=0), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    view = dl.view()["64"]
    assert view.fallback and view.k == 0 and view.acceptance == pytest.approx(0.0)
    picks = [dl.choose("64") for _ in range(4 + 8 + 16 + 16 + 16)]
    probes = [i + 1 for i, p in enumerate(picks) if p]
    # Each failed probe doubles the gap (4, 8, 16), capped at max_probe_every (16 here).
    assert probes == [4, 12, 28, 44, 60] and all(picks[i - 1] >= 1 for i in probes)
    # Asked for explicitly, speculation still runs (with the best k).
    assert dl.choose("64", fallback=False) >= 1


def test_medium_acceptance_picks_a_middle_k():
    dl = DraftLength(k_max=8, k_initial=4)
    # Per-token acceptance 0.5: half the first proposals accepted, half of those the second...
    spec = SpecStats(drafts=16, draft_tokens=64, accepted_tokens=15,
                     accepted_per_position=(8, 4, 2, 1), target_forwards=16)
    _feed(dl, "16", spec, draft_s=0.0005, verify_s=0.004, step_s=0.004)
    view = dl.view()["16"]
    assert view.acceptance == pytest.approx(0.5, abs=0.02)
    assert view.k == 2 and not view.fallback  # 1.75 tokens per 5 ms beat 1.5 per 4.5 ms


def test_invalid_initial_k():
    with pytest.raises(ValueError, match="speculative_k"):
        DraftLength(k_max=4, k_initial=5)


def test_a_drift_flips_the_choice_within_two_long_requests():
    dl = DraftLength(k_max=8, k_initial=4)
    _feed(dl, "32", _spec(12, 8, accept_first=12), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    assert dl.view()["32"].k == 8
    # Shifted text: ~100 rounds of k=1, almost nothing accepted.
    _feed(dl, "32", _spec(100, 1, accept_first=3), draft_s=0.0005, verify_s=0.004,
          step_s=0.003, times=2)
    view = dl.view()["32"]
    assert view.acceptance < 0.2 and view.fallback and view.k == 0


def test_probing_backs_off_and_resets_once_speculation_pays():
    dl = DraftLength(k_max=8, k_initial=4, probe_every=4)
    _feed(dl, "64", _spec(10, 4, accept_first=0), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    for _ in range(12):  # probes at 4 and 12: the gap is 16 now
        dl.choose("64")
    # The traffic is back in domain: every proposal accepted (the counters decay in 64).
    _feed(dl, "64", _spec(10, 4, accept_first=10), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    assert not dl.view()["64"].fallback
    assert dl.choose("64") >= 1
    _feed(dl, "64", _spec(10, 4, accept_first=0), draft_s=0.0005, verify_s=0.004,
          step_s=0.003)
    picks = [dl.choose("64") for _ in range(4)]
    assert picks == [0, 0, 0, picks[3]] and picks[3] >= 1  # back to the first gap
