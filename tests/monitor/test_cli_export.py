"""`tailwatch export`: a table's recent rows as CSV or Parquet from a real SQLite database."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from monitor.cli import main
from storage.models import Alert, FlagAudit, ProbeResult, ProbeRun


@pytest.fixture
def db_kind() -> str:
    """SQLite: the query runs on both databases in tests/storage."""
    return "sqlite"


@pytest.fixture
def filled(sessionmaker: sessionmaker[Session], migrated_url: str,
           monkeypatch: pytest.MonkeyPatch) -> datetime:
    now = datetime.now(UTC)
    with sessionmaker.begin() as s:
        for at, p99 in ((now - timedelta(days=10), 9.0), (now - timedelta(hours=2), 0.25)):
            run = ProbeRun(started_at=at, instance_id="i-1", kind="cycle")
            run.results.append(ProbeResult(at=at, bucket="64", path="compiled",
                                           decoding="speculative", count=4, p99_s=p99,
                                           accepted_per_position=[3, 2]))
            s.add(run)
        alert = Alert(fingerprint="f", rule="p99_latency_regression", labels={"bucket": "64"},
                      state="firing", started_at=now - timedelta(hours=1))
        s.add(alert)
        s.flush()
        s.add(FlagAudit(at=now - timedelta(minutes=30), name="speculative", scope="64",
                        actor="policy", source="auto", action="set", new_value=False,
                        reason="slow", alert_id=alert.id))
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    return now


def test_export_parquet_loads_in_a_fresh_pandas(filled: datetime, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "probe_results.parquet"
    code = main(["export", "--table", "probe_results", "--since", "7d", "--format", "parquet",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    script = ("import json, sys, pandas as pd; df = pd.read_parquet(sys.argv[1]); "
              "print(json.dumps({'n': len(df), 'p99': df['p99_s'].tolist(), "
              "'tz': str(df['at'].dt.tz), 'aps': df['accepted_per_position'].tolist()}))")
    done = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                          text=True, check=True, timeout=120)
    got = json.loads(done.stdout)
    # The 10-day-old row is outside --since 7d.
    assert got == {"n": 1, "p99": [0.25], "tz": "UTC", "aps": ["[3, 2]"]}


def test_export_flag_audits_as_csv_to_stdout_keeps_the_alert_id(
        filled: datetime, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["export", "--table", "flag_audits", "--since", "1d"])
    out = capsys.readouterr().out
    assert code == 0
    header, row, *rest = out.strip().splitlines()
    assert rest == []
    cells = dict(zip(header.split(","), row.split(","), strict=False))
    assert cells["name"] == "speculative" and cells["alert_id"] not in ("", None)


@pytest.mark.parametrize(("argv", "field"), [
    (["--table", "nope"], "--table"),
    (["--table", "alerts", "--since", "yesterday"], "--since"),
    (["--table", "alerts", "--since", "0s"], "--since"),
    (["--table", "alerts", "--format", "xlsx"], "--format"),
    (["--table", "alerts", "--format", "parquet"], "--out"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], field: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["export", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and field in err[0]
