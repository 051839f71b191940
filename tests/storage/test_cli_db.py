"""`tailwatch db upgrade|current|check` on a temporary SQLite database."""

from __future__ import annotations

import pytest

from monitor.cli import main
from storage import migrate


@pytest.fixture
def env_url(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    return sqlite_url


def test_upgrade_then_current(env_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "current"]) == 0
    assert f"base (behind: code needs {migrate.head()})" in capsys.readouterr().out
    assert main(["db", "check"]) == 1
    assert "tailwatch db upgrade" in capsys.readouterr().err
    assert main(["db", "upgrade"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"is at {migrate.head()}")
    assert migrate.current(env_url) == migrate.head()
    assert main(["db", "current"]) == 0
    assert capsys.readouterr().out.strip() == f"{migrate.head()} (head)"
    assert main(["db", "check"]) == 0


@pytest.mark.parametrize(("url", "expected"), [
    ("mysql://u@h/db", "database_url: unsupported database 'mysql'"),
    ("postgresql://postgres:s3cret@127.0.0.1:1/none",
     "database postgresql://postgres:***@127.0.0.1:1/none: connection failed"),
])
def test_errors_are_one_line_and_exit_1(
    url: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", url)
    assert main(["db", "upgrade"]) == 1
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "s3cret" not in err


def test_unknown_revision_is_one_line(env_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--revision", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert "nope" in err and len(err.splitlines()) == 1
