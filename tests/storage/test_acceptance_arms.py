"""Canary acceptance counts the optimized arm of canary cycles only."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from storage.queries import acceptance
from storage.queries.week import canary_acceptance_frame
from tests.storage.builders import T0, minutes, probe_run


def test_canary_acceptance_leaves_out_ab_arms_and_bursts(
        sessionmaker: sessionmaker[Session]) -> None:
    spec = {"drafts": 10, "draft_tokens": 40}
    with sessionmaker.begin() as s:
        s.add(probe_run(T0, [
            {**spec, "accepted_tokens": 30},  # the optimized arm: 0.75
            {**spec, "accepted_tokens": 4, "variant": "eager", "path": "eager"},
        ]))
        # A burst's rows are load on the engine (variant "optimized" too), not canaries.
        s.add(probe_run(T0 + minutes(1), [{**spec, "accepted_tokens": 0}], kind="burst"))
    with sessionmaker() as s:
        (row,) = acceptance(s, T0, T0 + minutes(10), source="canary")
        assert (row.draft_tokens, row.accepted_tokens, row.acceptance_rate) == (40, 30, 0.75)
        df = canary_acceptance_frame(s, T0, T0 + minutes(10), variant="optimized")
        assert df["drafted"].sum() == 40 and df["accepted"].sum() == 30
