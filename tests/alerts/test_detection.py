"""relative_change: the one definition every rule and report uses."""

from __future__ import annotations

import pytest

from alerts.detection import relative_change


def test_relative_change_is_signed_against_the_centre_and_undefined_at_zero() -> None:
    assert relative_change(1.5, 1.0) == pytest.approx(0.5)
    assert relative_change(0.5, -1.0) == pytest.approx(1.5)
    assert relative_change(0.8, 1.0) == pytest.approx(-0.2)
    assert relative_change(1.0, 0.0) is None
    assert relative_change(0.0, 0.0) is None


def test_exceedance_llr_scores_each_new_sample_against_the_quantile() -> None:
    import math

    from alerts.detection import EXCEEDANCE_RATIO, exceedance_llr

    p0 = 0.01
    p1 = EXCEEDANCE_RATIO * p0
    assert exceedance_llr(1, 1, 0.99) == pytest.approx(math.log(p1 / p0))
    assert exceedance_llr(0, 4, 0.99) == pytest.approx(4 * math.log((1 - p1) / (1 - p0)))
    assert exceedance_llr(0, 4, 0.99) < 0 < exceedance_llr(1, 4, 0.99)
    with pytest.raises(ValueError, match="above"):
        exceedance_llr(5, 4, 0.99)
    with pytest.raises(ValueError, match="q"):
        exceedance_llr(0, 4, 1.0)


def test_count_above_counts_the_samples_over_a_level() -> None:
    from alerts.detection import count_above
    from storage.sketches import Sketch

    s = Sketch.of([0.8, 0.9, 1.1, 1.3])
    assert count_above(s, 1.0) == 2
    assert count_above(s, 2.0) == 0
    assert count_above(Sketch(), 1.0) == 0
