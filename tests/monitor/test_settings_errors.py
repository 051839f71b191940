"""Config mistakes are one line naming the key and its closest valid spelling, exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitor.cli import main
from monitor.settings import get_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start each test with no TAILWATCH_* settings from the caller's environment."""
    import os

    for name in list(os.environ):
        if name.startswith("TAILWATCH_") and not name.startswith("TAILWATCH_TEST_"):
            monkeypatch.delenv(name)


def _config_show(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main([*argv, "config", "show"])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("engine:\n  bukets: [16, 32]\n",
     "unknown setting engine.bukets; did you mean engine.buckets?"),
    ("scheduler:\n  probe_interval: 5\n",
     "unknown setting scheduler.probe_interval; did you mean scheduler.probe_interval_s?"),
    ("api:\n  prot: 9000\n", "unknown setting api.prot; did you mean api.port?"),
    ("databse_url: sqlite://\n", "unknown setting databse_url; did you mean database_url?"),
])
def test_unknown_nested_keys_in_the_file_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str,
        message: str) -> None:
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml_text)
    code, err = _config_show(capsys, "--config", str(config))
    assert code == 1
    assert err.strip() == f"Error: invalid settings: config file {config}: {message}"


def test_malformed_yaml_names_file_line_and_column(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tailwatch.yaml"
    config.write_text("engine:\n  buckets: [16, 32\n  device: cpu\n")
    code, err = _config_show(capsys, "--config", str(config))
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert f"config file {config}: line 3, column 9:" in err


@pytest.mark.parametrize(("name", "message"), [
    ("TAILWATCH_SCHEDULER__PROBE_INTERVAL", "unknown setting TAILWATCH_SCHEDULER__PROBE_INTERVAL;"
     " did you mean TAILWATCH_SCHEDULER__PROBE_INTERVAL_S?"),
    ("TAILWATCH_DATABSE_URL", "unknown setting TAILWATCH_DATABSE_URL; did you mean "
     "TAILWATCH_DATABASE_URL?"),
    ("TAILWATCH_ENGINE__BUKETS", "unknown setting TAILWATCH_ENGINE__BUKETS; did you mean "
     "TAILWATCH_ENGINE__BUCKETS?"),
])
def test_unknown_environment_variables_are_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str,
        message: str) -> None:
    monkeypatch.setenv(name, "5")
    code, err = _config_show(capsys)
    assert code == 1
    assert err.strip() == f"Error: invalid settings: {message}"


def test_nested_json_in_an_environment_variable_is_checked_too(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAILWATCH_ENGINE", '{"bukets": [16]}')
    code, err = _config_show(capsys)
    assert code == 1
    assert err.strip() == ("Error: invalid settings: unknown setting engine.bukets; "
                           "did you mean engine.buckets?")


@pytest.mark.parametrize("value", ["16,32", "[16, 32]", " 16 , 32 "])
def test_list_values_in_env_accept_commas_and_json(monkeypatch: pytest.MonkeyPatch,
                                                   value: str) -> None:
    monkeypatch.setenv("TAILWATCH_ENGINE__BUCKETS", value)
    assert get_settings().engine.buckets == (16, 32)


def test_variables_that_are_not_settings_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TAILWATCH_URL", "TAILWATCH_LOG_LEVEL", "TAILWATCH_LOG_FORMAT"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("TAILWATCH_SCHEDULER__PROBE_INTERVAL_S", "5")
    assert get_settings().scheduler.probe_interval_s == 5.0


def test_a_bucket_of_one_token_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The buckets share graphs whose length is dynamic; torch specializes a length of 1.
    config = tmp_path / "tailwatch.yaml"
    config.write_text("engine:\n  buckets: [1, 16]\n  max_input_tokens: 64\n")
    code, err = _config_show(capsys, "--config", str(config))
    assert code == 1
    assert len(err.strip().splitlines()) == 1
    assert "buckets: the smallest edge must be >= 2, got 1" in err


@pytest.mark.parametrize(("value", "message"), [
    ("true", "engine.max_queue_tokens: must be a whole number, got True"),
    ("-5", "engine: max_queue_tokens: must be a whole number of tokens >= 0 (0: off), got -5"),
    ("lots", "engine.max_queue_tokens: Input should be a valid integer"),
    ("2.5", "engine.max_queue_tokens: Input should be a valid integer"),
    ("100", "engine: max_queue_tokens: must be 0 (off) or at least max_input_tokens + "
            "max_new_tokens_cap (1280: the largest request), got 100"),
])
def test_a_bad_queue_token_budget_is_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str) -> None:
    config = tmp_path / "tailwatch.yaml"
    config.write_text(f"engine:\n  max_queue_tokens: {value}\n")
    code, err = _config_show(capsys, "--config", str(config))
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert err.strip().startswith(f"Error: invalid settings: {message}")


def test_a_bool_in_an_engine_count_is_refused_not_read_as_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILWATCH_ENGINE", '{"max_batch": true}')
    with pytest.raises(ValueError, match="engine.max_batch: must be a whole number, got True"):
        get_settings()
    monkeypatch.delenv("TAILWATCH_ENGINE")
    assert get_settings(engine={"max_queue_tokens": 2048}).engine.max_queue_tokens == 2048
