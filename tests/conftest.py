"""Shared fixtures: database fixtures live in tests/utils/db.py."""

pytest_plugins = ["tests.utils.db"]
