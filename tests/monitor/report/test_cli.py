"""`tailwatch report` on a temporary SQLite database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from monitor.cli import main
from tests.monitor.report.synthetic import KV_BUDGET, fill_week


def test_report_writes_both_files(sessionmaker, migrated_url: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    fill_week(sessionmaker)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    monkeypatch.setenv("TAILWATCH_REPORT__KV_CACHE_BUDGET_BYTES", str(KV_BUDGET))
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    out = tmp_path / "out"
    assert main(["report", "--week", "2026-W48", "--out", str(out)]) == 0
    md = (out / "report-2026-W48.md").read_text()
    html = (out / "report-2026-W48.html").read_text()
    assert "### speculative decoding: VIOLATED" in md
    assert html.count('<img class="plot"') == 5
    said = capsys.readouterr().out
    assert "2026-W48: 4 violated, 1 at risk, 6 hold, 5 no data" in said


def test_report_on_empty_week_says_no_data(migrated_url: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    assert main(["report", "--week", "2026-W47", "--out", str(tmp_path)]) == 0
    assert "No data" in (tmp_path / "report-2026-W47.md").read_text()
    assert 'id="no-data"' in (tmp_path / "report-2026-W47.html").read_text()
    assert "(no data this week)" in capsys.readouterr().out


@pytest.mark.parametrize("week", ["2026-W99", "2026-48", "last week"])
def test_bad_week_exits_2_with_one_line(week: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--week", week, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("Error: --week:")
    assert repr(week) in err
    assert not list(tmp_path.iterdir())


def test_out_naming_a_file_exits_2_and_writes_nothing(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--out", str(tmp_path / "report.md")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("Error: --out:") and "directory" in err
    assert not list(tmp_path.iterdir())


def test_bad_week_exit_code_from_the_console(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "monitor.cli", "report", "--week", "W48"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path.parent,
                          env={"PYTHONPATH": str(Path(__file__).parents[3]),
                               "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "Error: --week: week: 'W48' is not of the form YYYY-Www "
        "(expected an ISO week such as 2026-W48)"]


def test_unmigrated_database_exits_1_naming_the_fix(sqlite_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    assert main(["report", "--week", "2026-W48", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tailwatch db upgrade" in err


def test_a_failed_report_leaves_no_empty_database_file(sqlite_url: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    assert main(["report", "--out", str(tmp_path / "out")]) == 1
    path = sqlite_url.removeprefix("sqlite:///")
    assert not Path(path).exists()
    err = capsys.readouterr().err
    assert err.startswith(f"Error: database or output: {path} does not exist")


def test_report_by_hand_reviews_the_last_seven_days(migrated_url: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from datetime import UTC, datetime, timedelta

    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    assert main(["report", "--out", str(tmp_path)]) == 0
    today = datetime.now(UTC).date()
    label = f"{(today - timedelta(days=6)).isoformat()}..{today.isoformat()}"
    assert (tmp_path / f"report-{label}.md").exists()
    out = capsys.readouterr().out
    assert out.startswith(f"{label}: ")
    assert "not stored" in out
