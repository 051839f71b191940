"""Secrets are masked by name and by value in `config show` and in error lines."""

from __future__ import annotations

import pytest
import yaml

from monitor.cli import main
from monitor.secrets import UNPARSABLE_URL, Masker, is_secret_name, mask_url
from tests.monitor.conftest import TOKEN

SECRETS = {
    "api-key-value-1": "X-Api-Key",
    "auth-token-value-2": "X-Auth-Token",
    "signing-key-value-3": "X-Signing-Key",
    "api_key_underscore-4": "api_key",
}


@pytest.fixture
def db_kind() -> str:
    """Run this module on SQLite only."""
    return "sqlite"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_secret_names_with_dashes_underscores_and_case():
    for name in ("X-Api-Key", "X-Auth-Token", "X-Signing-Key", "api_key", "apiKey",
                 "Authorization", "password", "sslpassword", "client_secret", "token"):
        assert is_secret_name(name), name
    for name in ("max_new_tokens", "max_input_tokens", "name", "url", "format", "host",
                 "Content-Type", "timeout"):
        assert not is_secret_name(name), name


def test_mask_url_forms():
    assert mask_url("postgresql+psycopg://tw:pw-1@db:5432/tw?sslmode=require") == (
        "postgresql+psycopg://tw:***@db:5432/tw?sslmode=require")
    masked = mask_url("postgresql://tw@db/tw?password=qpass-2&application_name=x")
    assert "qpass-2" not in masked and "application_name=x" in masked
    assert "tok-3" not in mask_url("https://hook.example/x?token=tok-3")
    assert mask_url("sqlite:///./var/tailwatch.db") == "sqlite:///./var/tailwatch.db"
    # Unparsable (a bad port, an open IPv6 bracket, no "//"): never echoed.
    for bad in ("postgresql://tw:pw-4@db:port/tw", "http://u:pw-4@[::1/x", "tw:pw-4@db/tw"):
        assert mask_url(bad) == UNPARSABLE_URL


def test_masker_hides_known_values_anywhere_in_text():
    masker = Masker.from_data({
        "database_url": "postgresql://tw:db-pw-5@db/tw?sslpassword=ssl-pw-6",
        "webhooks": [{"url": "https://u:hook-pw-7@hook.example/x",
                      "headers": {"X-Auth-Token": "hdr-tok-8"}}],
    })
    line = ("connect to db failed: password db-pw-5 rejected (ssl-pw-6), "
            "header hdr-tok-8, see postgresql://tw:db-pw-5@other/tw, hook-pw-7")
    out = masker.text(line)
    for secret in ("db-pw-5", "ssl-pw-6", "hook-pw-7", "hdr-tok-8"):
        assert secret not in out
    assert out.startswith("connect to db failed: password ")


def test_config_show_masks_every_form(tmp_path, monkeypatch, capsys):
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({
        "database_url": "postgresql://tw@db.internal/tw?password=query-pass-5",
        "alerts": {
            "external_url": "https://admin:ext-pass-6@tw.example",
            "webhooks": [{"name": "pager", "url": "https://hooks.example/in?token=url-tok-7",
                          "headers": {v: k for k, v in SECRETS.items()}}],
        },
    }))
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    code, out, err = run(capsys, "--config", str(config), "config", "show")
    assert code == 0, err
    for secret in [*SECRETS, "query-pass-5", "ext-pass-6", "url-tok-7", TOKEN]:
        assert secret not in out, secret
    shown = yaml.safe_load(out)
    assert shown["alerts"]["external_url"] == "https://admin:***@tw.example"
    assert shown["database_url"].startswith("postgresql://tw@db.internal/tw?password=")
    assert set(shown["alerts"]["webhooks"][0]["headers"]) == set(SECRETS.values())


def test_db_error_line_does_not_echo_an_unparsable_url(monkeypatch, capsys):
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", "postgresql://tw:db-pass-9@db:notaport/tw")
    code, out, err = run(capsys, "db", "current")
    assert code == 1
    assert "db-pass-9" not in err and "db-pass-9" not in out
    assert err.strip().count("\n") == 0


def test_db_error_line_masks_a_query_password(monkeypatch, capsys):
    monkeypatch.setenv("TAILWATCH_DATABASE_URL",
                       "postgresql+psycopg://tw@127.0.0.1:1/tw?password=q-pass-10&connect_timeout=1")
    code, out, err = run(capsys, "db", "current")
    assert code == 1
    assert "q-pass-10" not in err and err.strip().count("\n") == 0
    assert "127.0.0.1" in err


def test_serve_error_line_does_not_echo_an_unparsable_url(monkeypatch, capsys):
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("tailwatch serve started a server")

    monkeypatch.setattr("uvicorn.run", refuse)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", "postgresql://tw:serve-pass-11@db:port/tw")
    code, out, err = run(capsys, "serve", "--no-scheduler")
    assert code == 1
    assert "serve-pass-11" not in err and "serve-pass-11" not in out
    assert err.strip().count("\n") == 0
