"""`tailwatch serve` start-up errors about the database: one line, masked, non-zero exit."""

from __future__ import annotations

import pytest

from monitor.cli import main
from tests.monitor.conftest import TOKEN

SECRET = "serve-pw-4711"


@pytest.fixture(autouse=True)
def _no_real_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail fast instead of serving forever if `serve` gets past its pre-flight checks."""

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("tailwatch serve started a server")

    monkeypatch.setattr("uvicorn.run", refuse)
    monkeypatch.setenv("TAILWATCH_API_TOKEN", TOKEN)


def _serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           url: str) -> tuple[int, str]:
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", url)
    code = main(["serve", "--no-scheduler"])
    out = capsys.readouterr()
    assert SECRET not in out.out and SECRET not in out.err
    assert "Traceback" not in out.err
    assert out.err.strip().count("\n") == 0, out.err
    return code, out.err


@pytest.mark.parametrize("url", [
    f"postgresql://tw:{SECRET}@127.0.0.1:1/tw",
    f"postgresql+psycopg://tw@127.0.0.1:1/tw?password={SECRET}&connect_timeout=2",
])
def test_an_unreachable_database_is_one_masked_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    url: str) -> None:
    code, err = _serve(monkeypatch, capsys, url)
    assert code == 1
    assert err.startswith("Error: database: cannot connect to 'postgresql+psycopg://tw")
    assert "127.0.0.1:1/tw" in err and "Connection refused" in err
    assert "sqlalche.me" not in err  # SQLAlchemy's "Background on this error" link


@pytest.mark.postgres
def test_a_database_that_refuses_the_connection_is_one_masked_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _serve(monkeypatch, capsys,
                       f"postgresql://postgres:{SECRET}@127.0.0.1:5432/tailwatch_no_such_db")
    assert code == 1
    assert "postgres:***@127.0.0.1:5432/tailwatch_no_such_db" in err
    assert 'database "tailwatch_no_such_db" does not exist' in err


@pytest.mark.parametrize("url", [
    f"postgresql://tw:{SECRET}@db:port/tw",  # a port that is no number
    f"tw:{SECRET}@db.internal/tw",  # no scheme: the password would parse as a path
    f"postgresql://tw:{SECRET}@[::1/tw",  # an unclosed IPv6 bracket
])
def test_a_malformed_url_is_one_line_that_does_not_echo_it(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str],
                                                           url: str) -> None:
    code, err = _serve(monkeypatch, capsys, url)
    assert code == 1
    assert err.startswith("Error: database_url: cannot parse the URL")
    assert "db.internal" not in err and "@db" not in err
