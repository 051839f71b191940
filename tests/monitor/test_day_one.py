"""What a new operator meets first: the logs, --version, --url, a taken port."""

from __future__ import annotations

import json
import logging
import socket
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import OperationalError

from monitor.cli import main
from monitor.events import log_evaluation
from monitor.leader import PgAdvisoryLeader
from monitor.logs import configure_logging
from monitor.scheduler import DELIVERY, build_scheduler
from monitor.settings import Settings
from storage.db import make_engine


def test_json_log_lines_and_a_quiet_scheduler(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_LOG_LEVEL", "info")
    assert configure_logging(None, "json") == ("info", "json")
    logging.getLogger("apscheduler.executors.default").info(
        'Job "probe" executed successfully')
    logging.getLogger("tailwatch.events").info("alert 3 firing: p99")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(r["level"], r["logger"], r["message"]) for r in lines] == [
        ("info", "tailwatch.events", "alert 3 firing: p99")]
    assert lines[0]["time"].endswith("+00:00")


def test_log_level_from_the_environment_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="TAILWATCH_LOG_LEVEL: must be one of"):
        configure_logging()


def _down() -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception("connection refused\nDETAIL: long"))


def test_a_database_outage_logs_one_warning_and_one_recovery(
        caplog: pytest.LogCaptureFixture) -> None:
    outcomes: list[Exception | None] = [_down(), _down(), _down(), None, None]

    def job() -> None:
        exc = outcomes.pop(0)
        if exc is not None:
            raise exc

    js = build_scheduler(Settings(database_url="sqlite://"), {DELIVERY: job},
                         SimpleNamespace(is_leader=lambda: True, release=lambda: None))
    run = js.aps.get_job(DELIVERY).func  # the production wrapper the scheduler calls
    with caplog.at_level(logging.INFO, logger="monitor.scheduler"):
        for _ in range(5):
            run()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records
             if r.name == "monitor.scheduler"]
    assert [level for level, _ in lines] == ["WARNING", "INFO"], lines
    assert "database unavailable (OperationalError: connection refused)" in lines[0][1]
    assert lines[1][1] == "scheduled job delivery: recovered after 3 failed run(s)"
    assert not any(r.exc_info for r in caplog.records)
    assert js.stats()[DELIVERY].failures == 3


def test_a_failed_probe_run_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    js = build_scheduler(Settings(database_url="sqlite://"), {
        "probe": lambda: SimpleNamespace(status="timeout", error="bucket 64 hung")},
        SimpleNamespace(is_leader=lambda: True, release=lambda: None))
    with caplog.at_level(logging.INFO, logger="monitor.scheduler"):
        js.aps.get_job("probe").func()
    assert [r.getMessage() for r in caplog.records] == [
        "scheduled job probe: run ended timeout: bucket 64 hung"]


def test_leader_election_warns_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    # Nothing listens on port 1: every connect fails at once.
    engine = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/x", connect_timeout_s=1)
    leader = PgAdvisoryLeader(engine)
    with caplog.at_level(logging.DEBUG, logger="monitor.leader"):
        for _ in range(3):
            assert not leader.is_leader()
    levels = [r.levelname for r in caplog.records if r.name == "monitor.leader"]
    assert levels == ["WARNING", "DEBUG", "DEBUG"]
    engine.dispose()


def test_evaluation_logs_fired_and_resolved_with_labels_and_change(
        caplog: pytest.LogCaptureFixture) -> None:
    labels = {"bucket": "32", "path": "compiled"}
    report = SimpleNamespace(
        results=[SimpleNamespace(rule="p99_latency_up", labels=labels, relative_change=0.42,
                                 baseline=0.1, current=0.142)],
        transitions=[
            SimpleNamespace(alert_id=7, rule="p99_latency_up", labels=labels,
                            from_state="pending", to_state="firing", reason="cusum over h"),
            SimpleNamespace(alert_id=8, rule="p50_latency_up", labels={"bucket": "64"},
                            from_state=None, to_state="pending", reason="breach 1 of 3")],
        actions=[SimpleNamespace(kind="set", flag="speculative", scope="32", value=False,
                                 reason="acceptance fell", alert_id=7)])
    with caplog.at_level(logging.INFO, logger="tailwatch.events"):
        log_evaluation(report)
    assert [r.getMessage() for r in caplog.records] == [
        "alert 7 firing: p99_latency_up {bucket=32,path=compiled} change +42.0% "
        "(0.1 -> 0.142): cusum over h",
        "flag speculative[32] set to False by policy (alert 7): acceptance fell",
    ]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("tailwatch ")


def test_url_is_accepted_on_each_operator_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["flags", "list"], ["flags", "audit"], ["alerts", "list"],
                 ["baselines", "list"]):
        code = main([*argv, "--url", "http://127.0.0.1:1"])
        err = capsys.readouterr().err
        assert code == 1
        assert "cannot reach tailwatch at http://127.0.0.1:1" in err, (argv, err)


def test_a_taken_port_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("monitor.app.create_app", lambda *a, **k: pytest.fail("app built"))
    monkeypatch.setenv("TAILWATCH_API_TOKEN", "t")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"Error: api.port: cannot listen on 127.0.0.1:{port}: the address is already in use")
