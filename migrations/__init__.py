"""Alembic migrations of the tailwatch schema (run them with `tailwatch db upgrade`)."""
