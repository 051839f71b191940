"""bench.faults in a small configuration: the same fault runs, 0 lost and 0 duplicated.

Each run drives the production wiring (app lifespan, outbox and Deliverer, Writer,
Prober); only the faults are scripted: a receiver that refuses then hangs, PostgreSQL
cut behind a proxy, `kill -9` of a process writing to SQLite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faults import Config, report, run_database, run_kill9, run_webhooks
from tests.storage.ambiguous import ambiguous_commit

pytestmark = pytest.mark.slow

QUICK = Config.quick()


def test_a_receiver_down_then_hanging_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out = run_webhooks(QUICK, tmp_path)
    assert (out.lost, out.duplicated) == (0, 0), out.lines
    c = out.counts
    assert c["flaky_sent"] > 0 and c["healthy_sent"] > 0
    # The faults happened: the flaky target was tried and failed before it answered.
    assert c["max_attempts"] >= QUICK.refuse_rounds
    assert c["flaky_requests"] > c["flaky_received"]  # the hanging receiver was reached


@pytest.mark.postgres
def test_a_database_outage_loses_no_request_and_no_probe_result(pg_admin_url: str) -> None:
    # A cut between COMMIT and its answer once duplicated a batch, when the timing hit it;
    # every run now has such a commit for probe results and for traffic rollups (one commit
    # for both where the writer batched them together).
    with ambiguous_commit("probe_results", "traffic_rollups") as fired:
        out = run_database(QUICK, pg_admin_url)
    if out.skipped:
        pytest.skip(out.skipped)
    assert sorted(fired) == ["probe_results", "traffic_rollups"]
    assert (out.lost, out.duplicated) == (0, 0), out.lines
    c = out.counts
    assert c["answered"] == c["asked"] >= sum(QUICK.db_rounds) * QUICK.requests_per_round
    assert c["cycles"] >= sum(QUICK.db_rounds)
    assert c["writer_retries"] > 0  # the writes did wait for the database


def test_kill_9_while_writing_leaves_sqlite_intact_with_every_acknowledged_cycle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_kill9(QUICK, tmp_path)
    assert out.counts["integrity_ok"]
    assert out.counts["acknowledged"] > 0  # the children did write before dying
    assert (out.lost, out.duplicated) == (0, 0), out.lines
    assert report([out]) == (0, 0)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "lost: 0, duplicated: 0"
