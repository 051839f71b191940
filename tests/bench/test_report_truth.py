"""bench.report_truth's checks: the report's Markdown against the API's speedups and the tables.

The bench needs the real service for a quarter of an hour; what it checks is tested here
on reports the production code renders: a week written by the production writers
(tests.monitor.report.synthetic: speculation costs more than it earns in bucket 64) read
back as the API serves it, and an empty database's report, whose no-data sentences must
be the ones the bench looks for.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from datetime import UTC, datetime

import pytest

from bench.report_truth import (
    NEEDS,
    READ_NEEDS,
    Panel,
    Written,
    compare,
    costly_listed,
    count_written,
    empty_reads,
    empty_sections,
    findings,
    is_empty,
    missing_plots,
    optimization_keys,
    report_speedups,
    report_window,
)
from monitor.api.probes import SpeedupOut
from monitor.report import build_report, load_registry, render_html, render_markdown
from monitor.settings import Settings, get_settings
from storage.queries.speedups import ab_speedups
from tests.monitor.report.synthetic import WEEK, fill_week

NOW = datetime(2026, 11, 30, 6, tzinfo=UTC)
NAMES = optimization_keys()


@pytest.fixture
def report_settings(tmp_path) -> Settings:
    return get_settings(report={"out_dir": str(tmp_path / "reports"), "notify": False})


@pytest.fixture
def week(sessionmaker, report_settings: Settings):
    """Return (Markdown, the API's speedups as JSON, what the tables hold) of the week."""
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
        served = [json.loads(json.dumps(asdict(SpeedupOut(**asdict(s)))))
                  for s in ab_speedups(session, WEEK.start, WEEK.end)]
        wrote = count_written(session)
    return render_markdown(report), served, wrote


def test_a_truthful_report_matches_the_api_and_lists_every_slower_bucket(week) -> None:
    md, served, wrote = week
    shown = report_speedups(md, NAMES)
    cmp = compare(shown, costly_listed(md, NAMES), served)
    assert cmp.mismatched == [] and cmp.compared == len(served) == len(shown) > 0
    assert cmp.max_diff < 0.005  # three significant digits
    # The synthetic week: speculation is slower than direct in bucket 64.
    assert ("speculative", "64") in costly_listed(md, NAMES)
    assert cmp.costly_listed == cmp.costly_expected >= 1 and cmp.costly_missing == []
    assert wrote.ab_pairs > 0 and {"eager", "direct"} <= wrote.measured_arms
    assert empty_sections(md, wrote, NAMES) == []


def test_a_report_off_by_more_than_1_percent_or_missing_a_row_is_named(week) -> None:
    md, served, _ = week
    shown = report_speedups(md, NAMES)
    key = next(k for k in shown if k[1] == "all")
    value, pairs = shown[key]
    wrong = {**shown, key: (value * 1.02, pairs)}
    cmp = compare(wrong, costly_listed(md, NAMES), served)
    assert len(cmp.mismatched) == 1 and cmp.mismatched[0].startswith(f"{key[0]}[all]")
    assert cmp.max_diff == pytest.approx(0.02, abs=0.006)

    fewer = {k: v for k, v in shown.items() if k != key}
    assert compare(fewer, set(), served).mismatched[0].startswith(f"{key[0]}[all]: in the API (")
    assert compare(fewer, set(), served).mismatched[0].endswith("not in the report")
    miscounted = {**shown, key: (value, pairs + 1)}
    assert len(compare(miscounted, set(), served).mismatched) == 1


def test_a_slower_bucket_left_out_of_the_costly_list_is_named(week) -> None:
    md, served, _ = week
    # The costly table without its bucket-64 speculation row, as a report that missed it.
    costly = md.split("## Optimizations that cost more than they earn")[1].split("\n## ")[0]
    dropped = "\n".join(line for line in costly.splitlines()
                        if not line.startswith("| speculative decoding | 64 |"))
    cmp = compare(report_speedups(md, NAMES), costly_listed(md.replace(costly, dropped), NAMES),
                  served)
    assert cmp.costly_listed == cmp.costly_expected - 1
    assert [m.split(" ")[0] for m in cmp.costly_missing] == ["speculative[64]"]


def test_an_empty_report_says_so_in_every_section_and_matches_the_bench(
        sessionmaker, report_settings: Settings) -> None:
    with sessionmaker.begin() as session:
        md = render_markdown(build_report(session, "2026-W48", NOW, load_registry(),
                                          report_settings))
        nothing = count_written(session)
    assert nothing == Written()
    assert empty_sections(md, nothing, NAMES) == []
    # Every no-data sentence the bench looks for is the one the report writes.
    for title, needs in NEEDS.items():
        body = md.split(f"## {title}\n")[1].split("\n## ")[0]
        for need in needs:
            assert need.empty in body, (title, need.empty)
    # The same report where the tables hold everything: each no-data sentence is named.
    everything = Written(ab_pairs=1, probe_runs=1, traffic_requests=1, memory_samples=1,
                         flag_audits=1, alerts=1, fired_alerts=1, open_alerts=1, incidents=1,
                         agreements=1,
                         rollout_verdicts=1, sensitivities=1, active_baselines=1,
                         dead_deliveries=1, reports=1, measured_arms=frozenset({"eager"}))
    found = empty_sections(md, everything, NAMES)
    assert len(found) == sum(len(n) for n in NEEDS.values()) + 1  # + torch.compile n/a
    assert any(f.startswith("Optimizations: torch.compile") for f in found)
    # Alerts that went pending and cleared without firing notified nobody: the report
    # lists fired ones, so "no alerts this week" is its truth.
    assert empty_sections(md, Written(alerts=3, open_alerts=1), NAMES) == []
    blank = re.sub(r"(## Flag changes\n\n)_[^\n]*_\n", r"\1", md)
    assert "Flag changes: blank" in empty_sections(blank, nothing, NAMES)


def test_reads_empty_for_written_data_are_named_and_unknown_reads_listed() -> None:
    wrote = Written(probe_runs=3, ab_pairs=6)
    answers = {"/v1/probes/runs": [], "/v1/probes/speedups": [{"bucket": "all"}],
               "/v1/alerts": [], "/v1/instances": {"stale_after_s": 60, "instances": []},
               "/v1/new": []}
    empty, undefined = empty_reads(answers, wrote)
    assert [e.split(":")[0] for e in empty] == ["/v1/instances", "/v1/probes/runs"]
    assert undefined == ["/v1/new"]
    assert is_empty({}) and is_empty([]) and not is_empty({"a": 1}) and not is_empty([0])
    # GET /v1/flags with no flag set still shows the effective flags.
    assert not is_empty({"flags": [], "effective": {"compiled": True}})
    assert is_empty({"flags": [], "effective": {}})
    assert set(READ_NEEDS) >= {"/v1/probes/runs", "/v1/probes/speedups", "/v1/flags"}


def test_the_last_line_counts_what_was_found(week, tmp_path) -> None:
    md, served, wrote = week
    panels = [Panel("sum(tailwatch_a)", ("tailwatch_a",), (), True),
              Panel("sum(tailwatch_b)", ("tailwatch_b",), (), False),
              Panel("sum(tailwatch_c)", ("tailwatch_c",), ("tailwatch_c",), False)]
    out = findings(tmp_path, md, wrote, {"/v1/probes/runs": []}, served, panels)
    assert out["empty_panels"] == ["sum(tailwatch_b)"] and out["panels_checked"] == 2
    assert out["line"] == (f"report truth: {len(served)} speedups compared, max diff "
                           f"{out['comparison']['max_diff'] * 100:.2f}%, costly listed "
                           f"{out['comparison']['costly_listed']} of "
                           f"{out['comparison']['costly_expected']}, empty sections 0, "
                           "empty reads 1, empty panels 1")
    assert json.loads((tmp_path / "truth.json").read_text())["empty_reads"]


def test_a_plot_left_out_of_the_html_for_data_the_run_wrote_is_named(
        sessionmaker, report_settings: Settings) -> None:
    fill_week(sessionmaker)
    with sessionmaker.begin() as session:
        report = build_report(session, "2026-W48", NOW, load_registry(), report_settings)
        wrote = count_written(session)
    html = render_html(report)
    # The synthetic week has every plot's data: canaries, traffic, memory, a recompile.
    assert wrote.recompiles and wrote.canary_p99_rows and wrote.drafted
    assert missing_plots(html, wrote) == []
    without = html.replace('id="plot-memory"', 'id="plot-gone"')
    assert missing_plots(without, wrote) == [
        "Plots: no 'memory' plot although the run wrote memory samples"]
    assert missing_plots(without, Written()) == []


def test_the_window_is_read_from_the_report(week) -> None:
    md, _, _ = week
    assert report_window(md) == ("2026-11-23T00:00:00Z", "2026-11-30T00:00:00Z")
