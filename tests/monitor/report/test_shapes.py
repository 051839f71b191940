"""Bucket recommendations from exact input lengths: waste from the data, never worse edges."""

from __future__ import annotations

import pytest

from monitor.report.data import LengthBin
from monitor.report.shapes import propose_edges, summarize, waste


def _lengths(counts: dict[int, int]) -> tuple[LengthBin, ...]:
    return tuple(LengthBin(n, n, c) for n, c in sorted(counts.items()))


def test_traffic_just_under_an_edge_reports_its_small_waste_and_proposes_nothing_worse():
    # Inputs of 36-40 tokens against buckets (40, 80, 256): padding 0-4 tokens of 40.
    bins = _lengths({n: 100 for n in range(36, 41)})
    s = summarize(bins, (40, 80, 256))
    assert s is not None
    assert s.padding_waste == pytest.approx(0.05, abs=1e-9)  # (4+3+2+1+0)/5/40
    assert s.proposed_waste is not None and s.proposed_waste <= s.padding_waste
    assert 40 in s.proposed_edges  # exact counts find the edge that removes the waste


def test_the_dynamic_program_finds_the_least_padding_edges():
    bins = _lengths({10: 50, 30: 50, 60: 50})
    assert propose_edges(bins, 3) == (16, 32, 64)
    assert waste(bins, (16, 32, 64)) == pytest.approx(1 - 100 / 112)
    # Two edges for three clusters: the cheapest merge pads the small inputs.
    two = propose_edges(bins, 2)
    assert two[-1] == 64 and waste(bins, two) == min(
        waste(bins, (e, 64)) for e in (16, 32))  # type: ignore[type-var]


def test_better_edges_are_proposed_when_they_cut_padding():
    bins = _lengths({n: 10 for n in range(100, 121)})  # 100-120 tokens, bucket 256
    s = summarize(bins, (16, 64, 256))
    assert s is not None and s.proposed_waste is not None and s.padding_waste is not None
    assert s.proposed_edges[-1] == 120 and s.proposed_waste < s.padding_waste - 0.4
