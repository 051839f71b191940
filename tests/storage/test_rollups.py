"""Rollup upserts add counts, also when writers race for the same new row."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from storage.models import NaiveDatetimeError, TrafficRollup
from storage.rollups import RollupDelta, RollupKey, add_rollups, merge_deltas
from storage.sketches import Sketch
from tests.storage.builders import T0


def _one(latency: float = 0.2, **kw: object) -> RollupDelta:
    return RollupDelta.for_request(latency_s=latency, ttft_s=0.05, input_tokens=40,
                                   padded_length=64, output_tokens=20, **kw)  # type: ignore[arg-type]


def test_for_request_sketches_lengths_and_probation() -> None:
    d = _one(0.2, drafts=2, draft_tokens=8, accepted_tokens=6, probation=True)
    assert d.requests == 1 and Sketch.from_json(d.latency_sketch).count == 1
    assert Sketch.from_json(d.latency_sketch).quantile(0.5) == pytest.approx(0.2, rel=0.01)
    assert (d.probation_requests, d.probation_draft_tokens, d.probation_accepted) == (1, 8, 6)
    merged = d.merge(_one(0.04))
    assert merged.requests == 2 and merged.input_lens == {"40": 2} and merged.drafts == 2
    lat = Sketch.from_json(merged.latency_sketch)
    assert lat.count == 2 and lat.quantile(0.0) == pytest.approx(0.04, rel=0.01)


def test_keys_truncate_to_the_minute_and_refuse_naive_times() -> None:
    key = RollupKey(T0 + timedelta(seconds=59, microseconds=5), "i", "64", "compiled", "direct")
    assert key.minute == T0
    with pytest.raises(NaiveDatetimeError):
        RollupKey(T0.replace(tzinfo=None), "i", "64", "compiled", "direct")
    assert len(merge_deltas([(key, _one()), (key, _one())])) == 1


def test_concurrent_writers_add_up(sessionmaker: sessionmaker[Session]) -> None:
    keys = [RollupKey(T0, "i-1", b, "compiled", "speculative") for b in ("16", "64")]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(10):
                with sessionmaker.begin() as s:
                    add_rollups(s, [(k, _one(accepted_per_position=(1, 1))) for k in keys])
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    with sessionmaker() as s:
        rows = s.scalars(select(TrafficRollup).order_by(TrafficRollup.bucket)).all()
    assert [r.requests for r in rows] == [40, 40]
    assert [r.accepted_per_position for r in rows] == [[40, 40], [40, 40]]
    assert [Sketch.from_json(r.latency_sketch).count for r in rows] == [40, 40]
    assert [r.input_lens for r in rows] == [{"40": 40}, {"40": 40}]
