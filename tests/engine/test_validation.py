"""The request checks the runtime (and the service tests' fake engine) run before generating."""

from __future__ import annotations

import pytest

from engine import validation
from engine.config import EngineConfig
from engine.errors import InputTooLong, InvalidRequest

CONFIG = EngineConfig(buckets=(16, 32), max_input_tokens=40, max_new_tokens=8,
                      max_new_tokens_cap=16)


def test_token_budget_defaults_and_stays_within_the_cap() -> None:
    assert validation.max_new_tokens(CONFIG, None) == 8
    assert validation.max_new_tokens(CONFIG, 16) == 16
    for bad in (0, 17, True, "5", 2.0):
        with pytest.raises(InvalidRequest) as info:
            validation.max_new_tokens(CONFIG, bad)
        assert info.value.field == "max_new_tokens" and info.value.limit == 16


def test_text_must_be_a_non_blank_string_under_the_character_cap() -> None:
    assert validation.check_text(CONFIG, " ok ") == " ok "
    for bad in ("", "  \n", None, 7):
        with pytest.raises(InvalidRequest) as info:
            validation.check_text(CONFIG, bad)
        assert info.value.field == "text"
    cap = 40 * validation.MAX_CHARS_PER_TOKEN
    validation.check_text(CONFIG, "x" * cap)
    with pytest.raises(InputTooLong) as too_long:
        validation.check_text(CONFIG, "x" * (cap + 1))
    assert too_long.value.limit == cap and "refused before tokenizing" in str(too_long.value)


def test_token_count_and_timeout_limits() -> None:
    validation.check_input_tokens(CONFIG, 40)
    with pytest.raises(InputTooLong) as info:
        validation.check_input_tokens(CONFIG, 41)
    assert info.value.value == 41 and info.value.limit == 40
    validation.check_timeout(None)
    validation.check_timeout(0.5)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(InvalidRequest) as timeout:
            validation.check_timeout(bad)
        assert timeout.value.field == "timeout_s"
