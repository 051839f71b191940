"""`tailwatch canaries build` covers every bucket for a SentencePiece model; probes use it."""

from __future__ import annotations

import logging

import pytest
import yaml
from sqlalchemy import select

from monitor.cli import main
from probes.canaries import CanarySuite, by_bucket, load_suites_file
from tests.engine.own.conftest import BUCKETS, MAX_INPUT, own_config, sample_lines


@pytest.fixture
def config_file(tmp_path, own_models, sqlite_url, monkeypatch):
    for var in ("TAILWATCH_CONFIG", "TAILWATCH_DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "tailwatch.yaml"
    path.write_text(yaml.safe_dump({
        "database_url": sqlite_url,
        "instance_id": "own-test",
        "engine": {"model_dir": str(own_models["t5"]), "buckets": list(BUCKETS),
                   "max_input_tokens": MAX_INPUT, "max_new_tokens": 8,
                   "max_new_tokens_cap": 40, "compile_mode": "off", "device": "cpu"},
        "probes": {"suites_file": str(tmp_path / "suites.yaml"), "suite": "own",
                   "canaries_per_bucket": 2},
    }))
    return path


@pytest.mark.slow
def test_build_covers_every_bucket_with_references_then_probe_stores_every_bucket(
        tmp_path, config_file, own_models, sqlite_url, capsys):
    from engine import load_engine
    from storage import make_engine, make_sessionmaker
    from storage.migrate import upgrade
    from storage.models import ProbeResult, ProbeRun

    samples = tmp_path / "samples.txt"
    # Short lines only: the larger buckets need joined samples, the smallest cut ones.
    samples.write_text("\n".join(sample_lines(40, seed=21, words=(2, 6))) + "\n\n")
    out = tmp_path / "suites.yaml"
    assert main(["--config", str(config_file), "canaries", "build", "--from", str(samples),
                 "--per-bucket", "3", "--out", str(out)]) == 0, capsys.readouterr().err
    assert "probes.suite: own" in capsys.readouterr().out
    suites = load_suites_file(out)
    suite = suites["own"]
    assert {c.bucket for c in suite.canaries} == {str(b) for b in BUCKETS}
    assert len(suite.prompts) == len(set(suite.prompts)) == 3 * len(BUCKETS)
    assert suite.reference["path"] == "eager/float32/direct"
    held = suites.get("own_heldout")
    assert held is None or not set(held.prompts) & set(suite.prompts)
    reference = load_engine(own_config(own_models["t5"], max_new_tokens=8))
    try:
        assert suite.reference["model_version"] == reference.info.model_version
        for canary in suite.canaries:
            tokens = reference.count_tokens(canary.text)
            assert canary.tokens == tokens and reference.bucket_for(tokens) == canary.bucket
            assert canary.reference_ids == reference.generate(canary.text).output_ids
    finally:
        reference.close()
    # Writing over an existing suites file needs --force.
    assert main(["--config", str(config_file), "canaries", "build", "--from", str(samples),
                 "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err

    upgrade(sqlite_url)
    assert main(["--config", str(config_file), "probe", "--once", "--no-ab"]) == 0
    assert "buckets without canaries" not in capsys.readouterr().out
    db = make_engine(sqlite_url)
    try:
        with make_sessionmaker(db)() as session:
            run = session.scalars(select(ProbeRun)).one()
            assert (run.suite, run.status) == ("own", "ok")
            stored = {r.bucket for r in session.scalars(select(ProbeResult))}
    finally:
        db.dispose()
    assert stored >= {str(b) for b in BUCKETS}


def test_missing_samples_file_or_empty_one_is_one_line(tmp_path, config_file, capsys):
    code = main(["--config", str(config_file), "canaries", "build", "--from",
                 str(tmp_path / "nope.txt")])
    assert code != 0
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert main(["--config", str(config_file), "canaries", "build", "--from", str(empty),
                 "--out", str(tmp_path / "x.yaml")]) == 1
    err = capsys.readouterr().err
    assert "no non-empty line" in err and "Traceback" not in err


def test_probes_warn_at_start_when_a_bucket_has_no_canary(own_models, caplog):
    from engine import load_engine

    engine = load_engine(own_config(own_models["t5"]))
    try:
        suite = CanarySuite("short", "short", ("kalo mi",))
        with caplog.at_level(logging.WARNING, logger="probes.canaries"):
            plan = by_bucket(suite, engine, 2)
        assert list(plan) == ["8"]
        said = [r.getMessage() for r in caplog.records if r.name == "probes.canaries"]
        assert len(said) == 1 and "16, 32" in said[0] and "canaries build" in said[0]
    finally:
        engine.close()
