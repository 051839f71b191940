"""relative_change: the one definition (storage no longer keeps a twin)."""

from __future__ import annotations

import pytest

from alerts.detection import relative_change


def test_relative_change_is_signed_against_the_centre_and_undefined_at_zero() -> None:
    assert relative_change(1.5, 1.0) == pytest.approx(0.5)
    assert relative_change(0.5, -1.0) == pytest.approx(1.5)
    assert relative_change(0.8, 1.0) == pytest.approx(-0.2)
    assert relative_change(1.0, 0.0) is None
    assert relative_change(0.0, 0.0) is None
