"""A full `tailwatch serve` on a user's t5-small-shaped model plus one probe cycle."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml
from sqlalchemy import select

from monitor.cli import main
from monitor.loopback import free_port, wait_for
from tests.engine.own.conftest import BUCKETS, MAX_INPUT, sample_lines

TOKEN = "tw-own-model-token-5c1e"


@pytest.mark.slow
def test_serve_user_model_and_run_one_probe_cycle(tmp_path, own_models, sqlite_url,
                                                  monkeypatch):
    from storage import make_engine, make_sessionmaker
    from storage.migrate import upgrade
    from storage.models import ProbeResult, ProbeRun

    for var in [v for v in os.environ if v.startswith("TAILWATCH_")]:
        monkeypatch.delenv(var)
    port = free_port()
    suites = tmp_path / "suites.yaml"
    config = tmp_path / "tailwatch.yaml"
    config.write_text(yaml.safe_dump({
        "database_url": sqlite_url, "instance_id": "own-serve", "api_token": TOKEN,
        "engine": {"model_dir": str(own_models["t5"]), "buckets": list(BUCKETS),
                   "max_input_tokens": MAX_INPUT, "max_new_tokens": 8,
                   "max_new_tokens_cap": 40, "device": "cpu", "compile_backend": "eager",
                   "cache_dir": str(tmp_path / "compile-cache")},
        "probes": {"suites_file": str(suites), "suite": "own", "canaries_per_bucket": 2},
        "scheduler": {"enabled": False},
    }))
    samples = tmp_path / "samples.txt"
    samples.write_text("\n".join(sample_lines(60, seed=33, words=(2, 30))) + "\n")
    assert main(["--config", str(config), "canaries", "build", "--from", str(samples),
                 "--per-bucket", "2", "--out", str(suites)]) == 0
    upgrade(sqlite_url)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "monitor.cli", "--config", str(config), "serve", "--port",
             str(port), "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {TOKEN}"}
    try:
        def ready() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(ready, 240, interval_s=0.5)
        except TimeoutError as exc:
            pytest.fail(f"{exc}: {log.read_text()}")
        flags = httpx.get(f"{url}/v1/flags", headers=auth, timeout=10).json()["effective"]
        assert flags["speculative_available"] is False
        assert "draft_dir" in flags["speculative_reason"]
        gen = httpx.post(f"{url}/v1/generate", json={"text": "kalo mi ren", "max_new_tokens": 4},
                         headers=auth, timeout=60)
        assert gen.status_code == 200 and gen.json()["decoding"] == "direct"
        run = httpx.post(f"{url}/v1/probes/run", json={"kind": "cycle", "suite": "own",
                                                       "ab": False}, headers=auth, timeout=120)
        assert run.status_code == 200, run.text
        said = [line for line in log.read_text().splitlines() if "speculative decoding" in line]
        assert len(said) == 1 and "draft_dir" in said[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    db = make_engine(sqlite_url)
    try:
        with make_sessionmaker(db)() as session:
            runs = session.scalars(select(ProbeRun)).all()
            assert [(r.suite, r.status) for r in runs] == [("own", "ok")]
            results = session.scalars(select(ProbeResult)).all()
            assert {r.bucket for r in results} >= {str(b) for b in BUCKETS}
            assert {r.path for r in results} == {"compiled"}
    finally:
        db.dispose()
