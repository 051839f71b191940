"""Storage exceptions.

StorageError
 ├── SchemaBehind: the database is not at the code's migration head
 ├── DatabaseUnavailable: the database cannot be reached or stays locked
 └── InvalidQuery (also ValueError): a bad argument; names the field
      └── UnknownMetric: a metric name queries do not know
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of storage errors."""


class SchemaBehind(StorageError):
    """The database schema is not the revision this code needs."""

    def __init__(self, current: str | None, head: str):
        super().__init__(
            f"database schema is at {current or 'base (empty)'}, code needs {head}: "
            "run `tailwatch db upgrade`"
        )
        self.current = current
        self.head = head


class DatabaseUnavailable(StorageError):
    """The database cannot be reached."""


class InvalidQuery(StorageError, ValueError):
    """A query or storage argument is invalid."""

    def __init__(self, field: str, message: str, *, value: object = None):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.value = value


class UnknownMetric(InvalidQuery):
    """The metric name is not one the queries know."""
