"""`tailwatch config show`, `serve` pre-flight, and the operator commands over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from monitor.app import create_app
from monitor.cli import main
from monitor.cli.serve import effective
from monitor.hub import parts_of
from monitor.loopback import wait_for
from monitor.settings import Settings
from tests.monitor.conftest import OTHER_TOKEN, TOKEN, make_settings
from tests.monitor.fakes import FakeFactory
from tests.monitor.live import LiveServer


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only (flag and metric tests cover PostgreSQL)."""
    return "sqlite"


@pytest.fixture(autouse=True)
def _no_real_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail fast instead of serving forever if `serve` gets past its pre-flight checks."""

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("tailwatch serve started a server")

    monkeypatch.setattr("uvicorn.run", refuse)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_config_show_masks_secrets(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tailwatch.yaml"  # type: ignore[operator]
    config.write_text(yaml.safe_dump({
        "database_url": "postgresql://tw:db-pass-123@db.internal/tailwatch",
        "api": {"tokens": [{"name": "oncall", "token": OTHER_TOKEN}]},
        "alerts": {"webhooks": [{"name": "pager",
                                 "url": "https://hooks.example/services/T0/B0/slack-key-77",
                                 "secret": "hmac-secret-99",
                                 "headers": {"Authorization": "Bearer hook-token-42"}}]},
    }))
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_ENGINE__COMPILE_MODE", "off")
    code, out, err = run(capsys, "--config", str(config), "config", "show")
    assert code == 0, err
    for secret in (TOKEN, OTHER_TOKEN, "db-pass-123", "hmac-secret-99", "hook-token-42",
                   "slack-key-77"):
        assert secret not in out
    shown = yaml.safe_load(out)
    assert shown["engine"]["compile_mode"] == "off"  # env applied
    assert shown["api"]["tokens"][0]["name"] == "oncall"
    assert shown["api"]["tokens"][0]["token"] == "**********"
    assert shown["api_token"] == "**********"
    assert shown["database_url"] == "postgresql://tw:***@db.internal/tailwatch"
    assert shown["alerts"]["webhooks"][0]["url"] == "https://hooks.example/***"
    assert shown["alerts"]["webhooks"][0]["name"] == "pager"
    # Limits whose names merely contain "token" are settings, not secrets.
    assert shown["engine"]["max_new_tokens"] == 32
    assert shown["engine"]["max_input_tokens"] == 1024


def test_bad_settings_are_one_line(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_API__PORT", "eighty")
    code, out, err = run(capsys, "config", "show")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "api.port" in err


def test_serve_refuses_auth_without_token_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                      migrated_url: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TAILWATCH_API_TOKEN", raising=False)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    code, _, err = run(capsys, "serve", "--no-scheduler")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "TAILWATCH_API_TOKEN" in err


def test_serve_refuses_a_schema_behind_head_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                        sqlite_url: str,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", sqlite_url)
    code, _, err = run(capsys, "serve", "--no-scheduler")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "tailwatch db upgrade" in err


def test_serve_runs_uvicorn_with_the_app(monkeypatch: pytest.MonkeyPatch, migrated_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[object, dict[str, object]]] = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    # --no-worker: the worker child is covered by real processes in test_serve_worker.py.
    code, _, err = run(capsys, "serve", "--port", "8123", "--no-probes", "--no-worker")
    assert code == 0, err
    (app, kw), = calls
    assert parts_of(app).analysis_in_process is False  # never beside the engine in serve
    assert (kw["host"], kw["port"]) == ("127.0.0.1", 8123)
    settings = parts_of(app).settings  # built, not started
    assert settings.scheduler.enabled and not settings.scheduler.probes_enabled


def test_serve_flags_override_settings(migrated_url: str) -> None:
    base = make_settings(migrated_url, scheduler={"enabled": True})
    eff = effective(base, host="0.0.0.0", port=9123, no_scheduler=False, no_probes=True)
    assert (eff.api.host, eff.api.port) == ("0.0.0.0", 9123)
    assert eff.scheduler.enabled and not eff.scheduler.probes_enabled
    assert not effective(base, host=None, port=None, no_scheduler=True,
                         no_probes=False).scheduler.enabled
    assert base.api.port == 8000  # the original is untouched


def test_serve_refuses_a_bad_rules_file_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    migrated_url: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", migrated_url)
    monkeypatch.setenv("TAILWATCH_ALERTS__RULES_FILE", "/nonexistent/rules.yaml")
    code, _, err = run(capsys, "serve")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "/nonexistent/rules.yaml" in err


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    app = create_app(settings, engine_factory=FakeFactory(), registry=CollectorRegistry())
    with LiveServer(app) as live:
        wait_for(lambda: httpx.get(live.url + "/readyz").status_code == 200)
        yield live


def test_operator_flags_round_trip(server: LiveServer, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_URL", server.url)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", OTHER_TOKEN)
    code, out, err = run(capsys, "flags", "set", "speculative", "false", "--scope", "64",
                         "--reason", "acceptance collapsed on logs")
    assert code == 0, err
    assert out.strip() == "set speculative[64] = false"
    code, out, _ = run(capsys, "flags", "list")
    assert code == 0
    assert "speculative" in out and "oncall" in out and "acceptance collapsed" in out
    code, out, _ = run(capsys, "flags", "audit")
    assert code == 0 and "set" in out and "oncall" in out
    code, out, _ = run(capsys, "flags", "clear", "speculative", "--scope", "64",
                       "--reason", "recovered")
    assert code == 0 and out.strip() == "cleared speculative[64]"
    audit = httpx.get(server.url + "/v1/flags/audit").json()
    assert [(a["action"], a["actor"]) for a in audit] == [("clear", "oncall"),
                                                          ("set", "oncall")]


def test_operator_errors_are_one_line(server: LiveServer, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TAILWATCH_API_TOKEN", raising=False)
    code, _, err = run(capsys, "flags", "--url", server.url, "set", "compiled", "false",
                       "--reason", "x")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "HTTP 401" in err
    code, _, err = run(capsys, "flags", "--url", server.url, "--token", "wrong", "set",
                       "compiled", "false", "--reason", "x")
    assert code == 1 and "HTTP 403" in err
    code, _, err = run(capsys, "flags", "--url", server.url, "--token", TOKEN, "set",
                       "compiled", "maybe", "--reason", "x")
    assert code == 1 and "HTTP 422" in err and "value" in err
    code, _, err = run(capsys, "flags", "set", "compiled", "false")
    assert code != 0 and "--reason" in err
    code, _, err = run(capsys, "alerts", "--url", "http://127.0.0.1:9", "list")
    assert code == 1 and "cannot reach tailwatch" in err
    assert err.strip().count("\n") == 0


def test_operator_alerts_and_baselines(server: LiveServer, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_URL", server.url)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    code, out, err = run(capsys, "alerts", "list")
    assert code == 0, err
    assert out.strip() == "(none)"
    code, out, err = run(capsys, "baselines", "pin", "p99_latency", "--scope",
                         "bucket=64", "--value", "0.25", "--note", "after the upgrade")
    assert code == 0, err
    assert "pinned p99_latency" in out and "bucket=64" in out
    code, out, _ = run(capsys, "baselines", "list")
    assert code == 0 and "pinned" in out and "api-token" in out
    code, out, _ = run(capsys, "baselines", "unpin", "p99_latency", "--scope", "bucket=64")
    assert code == 0 and out.strip() == "unpinned 1 baseline(s) of p99_latency"
    code, _, err = run(capsys, "baselines", "pin", "p42_latency", "--value", "1")
    assert code == 1 and "metric" in err
