"""`tailwatch probe --once` with the fake engine standing in for the runtime."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from monitor.cli import main
from storage import make_engine, make_sessionmaker
from storage.migrate import upgrade
from storage.models import ProbeResult, ProbeRun
from tests.probes.fakes import use_placeholder_cli


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path, sqlite_url: str) -> str:
    use_placeholder_cli(monkeypatch, tmp_path, sqlite_url)
    monkeypatch.setenv("TAILWATCH_INSTANCE_ID", "cli-test")
    return sqlite_url


def test_behind_schema_says_to_upgrade(cli_env: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["probe", "--once"]) != 0
    err = capsys.readouterr().err
    assert "tailwatch db upgrade" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_once_stores_a_cycle_and_prints_every_bucket(
        cli_env: str, capsys: pytest.CaptureFixture) -> None:
    upgrade(cli_env)
    assert main(["probe", "--once", "--suite", "shifted", "--no-ab"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("probe cycle ok suite=shifted instance=cli-test")
    for bucket in ("16", "32", "64", "128", "256"):
        assert any(line.split()[0] == bucket for line in out.splitlines()[2:] if line.strip())
    assert "recompiles: 0" in out and "memory growth: +0.0 MiB RSS" in out
    db = make_engine(cli_env)
    with make_sessionmaker(db)() as s:
        run = s.scalars(select(ProbeRun)).one()
        assert (run.suite, run.instance_id, run.status) == ("shifted", "cli-test", "ok")
        assert len(s.scalars(select(ProbeResult)).all()) == 5
    db.dispose()


def test_json_output(cli_env: str, capsys: pytest.CaptureFixture) -> None:
    upgrade(cli_env)
    assert main(["probe", "--once", "--json", "--ab"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "ok" and data["ab"] is True
    # The default arms; "exact" is opt-in (it compiles every canary length once).
    assert {g["variant"] for g in data["groups"]} == {"optimized", "eager", "direct"}
    assert data["rss_growth_bytes"] == 0


@pytest.mark.parametrize(("args", "needle"), [
    (["probe"], "--once"), (["probe", "--once", "--suite", "nope"], "unknown suite 'nope'")])
def test_bad_usage_is_one_line(cli_env: str, capsys: pytest.CaptureFixture,
                               args: list[str], needle: str) -> None:
    upgrade(cli_env)
    assert main(args) != 0
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
