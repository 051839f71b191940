"""Queries return the right numbers on hand-built data, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import date, datetime, timedelta

import pytest
from sqlalchemy.orm import Session, sessionmaker

from storage import queries
from storage.errors import InvalidQuery
from storage.models import Baseline
from storage.rollups import RollupDelta, RollupKey, add_rollups
from tests.storage.builders import T0, probe_run

HOUR = timedelta(hours=1)


def _request(latency: float, tokens: int = 50, **kw: object) -> RollupDelta:
    return RollupDelta.for_request(latency_s=latency, ttft_s=latency / 4, input_tokens=tokens,
                                   padded_length=kw.pop("padded", 64), output_tokens=10, **kw)  # type: ignore[arg-type]


def test_baseline_in_force_pinned_wins_else_rolling_of_the_current_cohort(
    sessionmaker: sessionmaker[Session],
) -> None:
    scope = {"bucket": "64", "path": "compiled"}
    key = "bucket=64,path=compiled"

    def row(value: float, kind: str, at: datetime, mv: str = "m1", **kw: object) -> Baseline:
        return Baseline(metric="p95_s", scope=scope, scope_key=key, value=value, kind=kind,
                        created_at=at, model_version=mv, config_hash="c1", **kw)

    with sessionmaker.begin() as s:
        s.add_all([
            row(0.3, "rolling", T0, spread=0.01),
            row(0.4, "rolling", T0 + HOUR, mv="m2", spread=0.02),  # newer, other cohort
            row(9.0, "rolling", T0 + 2 * HOUR, active=False),
        ])
    with sessionmaker() as s:
        rolling = queries.baseline_in_force(s, "p95_s", scope, ("m1", "c1"))
        other = queries.baseline_in_force(s, "p95_s", key, ("m2", "c1"))
        any_cohort = queries.baseline_in_force(s, "p95_s", scope, None)
        missing = queries.baseline_in_force(s, "p95_s", {"bucket": "16"}, ("m1", "c1"))
    assert rolling.pinned is None and rolling.baseline is not None
    assert (rolling.baseline.value, rolling.baseline.spread) == (0.3, 0.01)
    assert other.baseline is not None and other.baseline.value == 0.4
    assert any_cohort.baseline is not None and any_cohort.baseline.value == 0.4
    assert missing.baseline is None
    with sessionmaker.begin() as s:
        s.add_all([row(0.1, "pinned", T0 - HOUR, mv="m0", pinned_by="ana"),
                   row(0.2, "pinned", T0 + 3 * HOUR, pinned_by="bo", active=False)])
    with sessionmaker() as s:
        force = queries.baselines_in_force(s, "p95_s", ("m1", "c1"))[key]
    # A pinned baseline of an older cohort still wins; the rolling one stays for its spread.
    assert force.baseline is force.pinned and force.pinned is not None
    assert force.pinned.value == 0.1 and force.rolling is not None and force.rolling.value == 0.3


def test_acceptance_per_bucket_per_day_for_canaries_traffic_and_probation(
    sessionmaker: sessionmaker[Session],
) -> None:
    day2 = T0 + timedelta(days=1)
    spec = {"drafts": 5, "draft_tokens": 20, "accepted_tokens": 10,
            "accepted_per_position": [4, 3, 2, 1]}
    with sessionmaker.begin() as s:
        s.add(probe_run(T0, [dict(spec), {"bucket": "16", **spec, "accepted_tokens": 20}]))
        s.add(probe_run(T0 + HOUR, [dict(spec)]))
        s.add(probe_run(day2, [{**spec, "accepted_tokens": 0, "accepted_per_position": [0]}]))
        key = RollupKey(T0, "i-1", "64", "compiled", "speculative")
        add_rollups(s, [(key, _request(0.1, drafts=4, draft_tokens=16, accepted_tokens=12,
                                       accepted_per_position=(4, 4, 3, 1)))])
        add_rollups(s, [(key, _request(0.1, drafts=4, draft_tokens=16, accepted_tokens=4,
                                       probation=True))])
    with sessionmaker() as s:
        daily = queries.acceptance(s, T0, T0 + timedelta(days=2), by_day=True)
        traffic = queries.acceptance(s, T0, T0 + HOUR, source="traffic")
        probation = queries.acceptance(s, T0, T0 + HOUR, source="probation")
        with pytest.raises(InvalidQuery, match="source"):
            queries.acceptance(s, T0, T0 + HOUR, source="nope")
    got = {(a.day, a.bucket): a for a in daily}
    first = got[(date(2026, 11, 2), "64")]
    assert first.draft_tokens == 40 and first.accepted_tokens == 20
    assert first.acceptance_rate == pytest.approx(0.5)
    assert first.mean_acceptance_length == pytest.approx(3.0)
    assert first.accepted_per_position == (8, 6, 4, 2)
    assert got[(date(2026, 11, 2), "16")].acceptance_rate == pytest.approx(1.0)
    assert got[(date(2026, 11, 3), "64")].acceptance_rate == 0.0
    (t,) = traffic
    assert t.requests == 2 and t.acceptance_rate == pytest.approx(0.5)
    assert t.accepted_per_position == (4, 4, 3, 1)
    (p,) = probation
    assert p.requests == 1 and p.acceptance_rate == pytest.approx(0.25)


def test_week_frames_see_pending_rows_and_return_utc_times(
    sessionmaker: sessionmaker[Session],
) -> None:
    from storage.queries import week

    with sessionmaker.begin() as s:
        s.add(probe_run(T0 + HOUR, [{"p50_s": 0.1, "p99_s": 0.2}]))
        # Not flushed yet: the frame must still see it (read_sql bypasses autoflush).
        df = week.canary_results_frame(s, T0, T0 + 2 * HOUR, kind="cycle")
    assert df["p99_s"].tolist() == [0.2]
    assert str(df["at"].dt.tz) == "UTC" and df["at"].iloc[0] == T0 + HOUR
