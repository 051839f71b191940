"""Add per-key deltas to rollup rows that several writers share (traffic, batching).

One lock order for every writer (existing rows locked, then missing rows inserted, both
sorted by key): two transactions adding to the same keys queue instead of deadlocking. A
writer that loses an insert race adds its delta to the winner's row instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from sqlalchemy import select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

K = TypeVar("K")  # a frozen dataclass whose fields are the row's key columns, in order
D = TypeVar("D")  # a frozen dataclass of the amounts to add, named as the row's columns
R = TypeVar("R")  # the ORM row


@dataclass(frozen=True)
class RollupTable(Generic[K, D, R]):
    """How to find, create and add to the rows of one rollup table."""

    model: type[R]
    key: type[K]
    add: Callable[[str, Any, Any], Any]  # (column, stored, delta) -> new value
    new_value: Callable[[str, Any], Any] = lambda _name, value: value

    def columns(self) -> tuple[str, ...]:
        """Return the key's column names, in the key's field order."""
        return tuple(f.name for f in fields(self.key))  # type: ignore[arg-type]

    def values(self, key: K) -> tuple[Any, ...]:
        """Return the key as a tuple (the order rows are locked in)."""
        return tuple(getattr(key, c) for c in self.columns())


def add_deltas(session: Session, table: RollupTable[K, D, R], merged: dict[K, D]) -> int:
    """Add each delta to its row, creating missing rows; return the rows touched."""
    if not merged:
        return 0
    merged = dict(sorted(merged.items(), key=lambda kv: table.values(kv[0])))
    existing = _load(session, table, list(merged))
    missing = [k for k in merged if k not in existing]
    for key, row in existing.items():
        _apply(table, row, merged[key])
    if missing:
        try:
            with session.begin_nested():
                session.add_all([_new_row(table, k, merged[k]) for k in missing])
        except IntegrityError:
            # Another writer inserted some of these rows meanwhile: add to theirs.
            for key in missing:
                won = _load(session, table, [key]).get(key)
                if won is not None:
                    _apply(table, won, merged[key])
                else:
                    with session.begin_nested():
                        session.add(_new_row(table, key, merged[key]))
    session.flush()
    return len(merged)


def _apply(table: RollupTable[K, D, R], row: R, delta: D) -> None:
    for f in fields(delta):  # type: ignore[arg-type]
        value = getattr(delta, f.name)
        if value:
            # Assign a new value: JSON columns do not track in-place changes.
            setattr(row, f.name, table.add(f.name, getattr(row, f.name), value))


def _new_row(table: RollupTable[K, D, R], key: K, delta: D) -> R:
    row = table.model(**{c: getattr(key, c) for c in table.columns()})
    for f in fields(delta):  # type: ignore[arg-type]
        setattr(row, f.name, table.new_value(f.name, getattr(delta, f.name)))
    return row


def _load(session: Session, table: RollupTable[K, D, R], keys: list[K]) -> dict[K, R]:
    names = table.columns()
    cols = [getattr(table.model, c) for c in names]
    out: dict[K, R] = {}
    for i in range(0, len(keys), 200):
        chunk = keys[i:i + 200]
        stmt = (select(table.model)
                .where(tuple_(*cols).in_([table.values(k) for k in chunk]))
                .order_by(*cols).with_for_update())
        for row in session.scalars(stmt):
            out[table.key(*(getattr(row, c) for c in names))] = row
    return out
