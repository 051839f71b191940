"""Fakes for probe tests: the protocol-level fake engine and placeholder canary suites."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from probes.burst import BurstResult
from probes.canaries import CanarySuite
from probes.cycle import CycleResult
from probes.fake import FakeEngine, FakeTimings
from probes.sink import add_burst, add_cycle
from storage.models import ProbeRun
from storage.writer import Writer

__all__ = ["FakeEngine", "FakeTimings", "placeholder_suites", "prompt_of", "store", "use_placeholder_cli"]


def store(sessions: sessionmaker[Session], result: CycleResult | BurstResult) -> int:
    """Store `result` as the Prober does (through a storage Writer); return its run id."""
    writer = Writer(sessions)
    try:
        if isinstance(result, CycleResult):
            writer.submit(partial(add_cycle, c=result))
        else:
            writer.submit(partial(add_burst, b=result))
        assert writer.flush(timeout=30) and writer.stats.failed == 0, writer.stats
    finally:
        writer.close()
    with sessions() as session:
        run_id = session.scalar(select(func.max(ProbeRun.id)))
    assert run_id is not None
    return run_id

_WORDS = ("river", "stone", "green", "field", "small", "house", "light", "water")
_SHIFTED = ("ERR_42", "k8s_pod", "0x1f", "GET", "/api/v2", "rc=-1", "NaN", "nil")


def prompt_of(n_bytes: int, words: tuple[str, ...] = _WORDS, seed: int = 0) -> str:
    """Return a text of exactly `n_bytes` bytes built from `words`."""
    rng = random.Random(seed)
    text = ""
    while len(text) < n_bytes:
        text += rng.choice(words) + " "
    return text[:n_bytes].rstrip().ljust(n_bytes, "a")


def placeholder_suites(per_bucket: int = 2) -> dict[str, CanarySuite]:
    """Return in_domain and shifted suites with `per_bucket` prompts in every default bucket."""
    sizes = (10, 25, 50, 100, 200)  # bytes; +1 EOS token lands in 16/32/64/128/256
    out = {}
    for name, words in (("in_domain", _WORDS), ("shifted", _SHIFTED)):
        prompts = tuple(prompt_of(n - i, words, seed=i) for n in sizes for i in range(per_bucket))
        out[name] = CanarySuite(name, name, prompts, 16, "placeholder")
    return out


def use_placeholder_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str) -> None:
    """Point `tailwatch probe` at placeholder suites, the fake engine and database `url`."""
    suites_file = tmp_path / "suites.yaml"
    lines = ["suites:"]
    for s in placeholder_suites(2).values():
        lines.append(f"  - name: {s.name}\n    domain: {s.domain}\n    prompts:")
        lines += [f"      - {json.dumps(p)}" for p in s.prompts]
    suites_file.write_text("\n".join(lines) + "\n")
    # Placeholder canaries stand in for the shipped ones (tested in test_canaries.py).
    monkeypatch.setattr("probes.canaries.DEFAULT_SUITES_FILE", suites_file)
    monkeypatch.setenv("TAILWATCH_DATABASE_URL", url)
    monkeypatch.setenv("TAILWATCH_PROBES__CANARIES_PER_BUCKET", "2")
    monkeypatch.delenv("TAILWATCH_CONFIG", raising=False)

    def fake_load(settings: object) -> FakeEngine:
        engine = FakeEngine()
        engine.warm_up()
        return engine

    monkeypatch.setattr("monitor.cli.probe.load_engine", fake_load)
