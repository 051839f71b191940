"""Migrations: empty -> head -> base on SQLite and PostgreSQL, and models match them."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from storage import migrate
from storage.db import make_engine
from storage.errors import SchemaBehind
from storage.models import Base

TABLES = {t.name for t in Base.metadata.sorted_tables}


def test_upgrade_to_head_then_downgrade_to_base(db_url: str) -> None:
    assert migrate.current(db_url) is None
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head()
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) >= TABLES
        migrate.downgrade(db_url, "base")
        with engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) & TABLES == set()
    finally:
        engine.dispose()
    assert migrate.current(db_url) is None


def test_models_match_migrations(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_check_schema_names_both_revisions_and_the_command(db_url: str) -> None:
    with pytest.raises(SchemaBehind) as info:
        migrate.check_schema(db_url)
    message = str(info.value)
    assert migrate.head() in message and "tailwatch db upgrade" in message
    migrate.upgrade(db_url)
    assert migrate.check_schema(db_url) == migrate.head()


def test_upgrade_on_a_passed_connection_leaves_commit_to_the_caller(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            conn.begin()
            migrate.upgrade(conn)
            conn.rollback()
        assert migrate.current(engine) is None
        with engine.begin() as conn:
            migrate.upgrade(conn)
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()


def test_0002_backfills_spread_and_alert_id_and_downgrade_restores_the_text(db_url: str) -> None:
    migrate.upgrade(db_url, "0001")
    engine = make_engine(db_url)
    at = "2026-11-02 00:00:00+00:00"
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO alerts (id, fingerprint, rule, labels, annotations, severity, state,"
                " started_at, updated_at, consecutive_breaches, consecutive_ok) VALUES"
                " (7, 'f', 'r', '{}', '{}', 'warning', 'firing', :at, :at, 0, 0)"), {"at": at})
            for i, kind, note in ((1, "rolling", "spread=0.025"),
                                  (2, "pinned", "after upgrade spread=0.5"),
                                  (3, "pinned", "by hand")):
                conn.execute(text(
                    "INSERT INTO baselines (id, metric, scope, scope_key, value, samples, kind,"
                    " model_version, config_hash, created_at, note, active) VALUES"
                    " (:i, 'p99_latency', '{}', '', 1.0, 3, :kind, '', '', :at, :note, true)"),
                    {"i": i, "kind": kind, "note": note, "at": at})
            for i, reason in ((1, "p: r firing (x) [alert 7]"), (2, "restored: ok [alert 99]"),
                              (3, "by hand")):
                conn.execute(text(
                    "INSERT INTO flag_audits (id, at, name, scope, actor, source, action, reason)"
                    " VALUES (:i, :at, 'speculative', '64', 'policy', 'auto', 'set', :reason)"),
                    {"i": i, "at": at, "reason": reason})
        migrate.upgrade(db_url)
        with engine.connect() as conn:
            baselines = conn.execute(text("SELECT id, spread, note FROM baselines ORDER BY id")).all()
            audits = conn.execute(text("SELECT id, alert_id, reason FROM flag_audits ORDER BY id")).all()
        assert [tuple(r) for r in baselines] == [(1, 0.025, None), (2, 0.5, "after upgrade"),
                                                 (3, None, "by hand")]
        # Alert 99 no longer exists: the key stays NULL, the reason keeps its text.
        assert [(r[0], r[1]) for r in audits] == [(1, 7), (2, None), (3, None)]
        assert audits[0][2].endswith("[alert 7]")
        migrate.downgrade(db_url, "0001")
        with engine.connect() as conn:
            notes = conn.execute(text("SELECT note FROM baselines ORDER BY id")).scalars().all()
            columns = {c["name"] for c in inspect(conn).get_columns("flag_audits")}
        assert notes == ["spread=0.025", "after upgrade spread=0.5", "by hand"]
        assert "alert_id" not in columns
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")


def test_0012_adds_batch_tokens_unique_per_token_and_downgrade_drops_them(db_url: str) -> None:
    from sqlalchemy.exc import IntegrityError

    migrate.upgrade(db_url, "0011_batchmon")
    engine = make_engine(db_url)
    insert = text("INSERT INTO applied_batches (token, applied_at) VALUES ('t1', :at)")
    at = {"at": "2026-11-02 00:00:00+00:00"}
    try:
        with engine.connect() as conn:
            assert "applied_batches" not in inspect(conn).get_table_names()
        migrate.upgrade(db_url, "0012_batch_tokens")
        with engine.begin() as conn:
            conn.execute(insert, at)
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(insert, at)  # what tells a retry that its batch committed
        migrate.downgrade(db_url, "0011_batchmon")
        with engine.connect() as conn:
            assert "applied_batches" not in inspect(conn).get_table_names()
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")


def test_0014_counts_settled_incidents_and_0015_clears_fired_at_of_late_runs(
        db_url: str) -> None:
    migrate.upgrade(db_url, "0013_notified_severity")
    engine = make_engine(db_url)
    at = {"at": "2026-11-02 00:00:00+00:00"}
    incident = text(
        "INSERT INTO incidents (id, state, started_at, updated_at, severity, families, buckets,"
        " instances, cohorts, summary, cause, cause_text, evidence, reopened, notified_members)"
        " VALUES (:id, :state, :at, :at, 'page', '[]', '[]', '[]', '[]', '', :cause, '', '{}',"
        " 0, '[]')")
    alert = text(
        "INSERT INTO alerts (id, fingerprint, rule, labels, annotations, severity, state,"
        " started_at, updated_at, fired_at, resolved_at, consecutive_breaches, consecutive_ok)"
        " VALUES (:id, :fp, 'r', '{}', '{}', 'page', 'resolved', :at, :at, :at, :at, 0, 0)")
    move = text("INSERT INTO alert_transitions (id, alert_id, at, from_state, to_state)"
                " VALUES (:id, :id, :at, 'pending', :to)")
    try:
        with engine.begin() as conn:
            for i, state, cause in ((1, "open", "unknown"), (2, "open", "host_or_load"),
                                    (3, "resolved", "unknown")):
                conn.execute(incident, {"id": i, "state": state, "cause": cause, **at})
            # Alert 2's run was late: the lifecycle then set its fired_at too.
            for i, to in ((1, "firing"), (2, "late")):
                conn.execute(alert, {"id": i, "fp": f"f{i}", **at})
                conn.execute(move, {"id": i, "to": to, **at})
        migrate.upgrade(db_url, "0014_counted_cause")
        with engine.connect() as conn:
            counted = conn.execute(text("SELECT id, counted_cause FROM incidents ORDER BY id"))
            # An open incident with an unknown cause is not counted until it is settled.
            assert [tuple(r) for r in counted] == [(1, None), (2, "host_or_load"),
                                                   (3, "unknown")]
        migrate.upgrade(db_url, "0015_late_not_fired")
        with engine.connect() as conn:
            fired = conn.execute(text("SELECT id, fired_at IS NULL FROM alerts ORDER BY id"))
            assert [(i, bool(cleared)) for i, cleared in fired] == [(1, False), (2, True)]
        migrate.downgrade(db_url, "0013_notified_severity")
        with engine.connect() as conn:
            fired = conn.execute(text("SELECT id, fired_at = resolved_at FROM alerts ORDER BY id"))
            assert [(i, bool(same)) for i, same in fired] == [(1, True), (2, True)]
            columns = {c["name"] for c in inspect(conn).get_columns("incidents")}
        assert "counted_cause" not in columns
    finally:
        engine.dispose()
        migrate.downgrade(db_url, "base")
