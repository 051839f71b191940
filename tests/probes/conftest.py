"""Probe test fixtures: a warm fake engine and placeholder suites."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from probes.canaries import CanarySuite
from tests.probes.fakes import FakeEngine, placeholder_suites


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    """Return a warmed-up fake engine (closing it releases any hung call)."""
    e = FakeEngine()
    e.warm_up()
    yield e
    e.close()


@pytest.fixture
def suites() -> dict[str, CanarySuite]:
    """Return placeholder in_domain and shifted suites covering every bucket."""
    return placeholder_suites(per_bucket=2)


@pytest.fixture
def rng() -> random.Random:
    """Return a seeded random generator."""
    return random.Random(1234)
