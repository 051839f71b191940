"""Settings -> validated alerts objects; replicas claiming the outbox concurrently."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.orm import Session, sessionmaker

from alerts.config import load_config
from alerts.errors import ConfigError
from alerts.outbox import Deliverer, enqueue
from alerts.settings import AlertSettings
from alerts.webhooks import Notification, WebhookTarget
from tests.alerts.test_outbox import T0, Clock


def test_load_config_from_settings(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: mine\n    metric: ttft\n    change: '+40%'\n")
    s = AlertSettings(rules_file=str(rules), policy_file=None, external_url="http://tw",
                      webhooks=[{"name": "ops", "url": "http://127.0.0.1:1/x"}],
                      baseline_refresh_s=60, baseline_warm_in_s=0, resend_interval_s=90)
    c = load_config(s)
    assert "mine" in {r.name for r in c.rules} and c.targets[0].name == "ops"
    assert c.baselines.refresh_s == 60 and c.baselines.warm_in_s == 0 and c.resend_s == 90
    assert c.policy.policies
    rules.write_text("rules:\n  - name: mine\n    metric: ttft\n")
    with pytest.raises(ConfigError) as info:
        load_config(s)
    assert info.value.field == "change" and "rule 'mine'" in str(info.value)


def test_two_replicas_claim_disjoint_rows(sessionmaker: sessionmaker[Session]):
    tgt = WebhookTarget(name="t", url="http://127.0.0.1:9/x")
    with sessionmaker.begin() as s:
        for i in range(40):
            enqueue(s, Notification(key=f"k{i}", title="t", text="x", at=T0), [tgt])
    clock = Clock()
    replicas = [Deliverer(sessionmaker, [tgt], clock=clock, batch=25) for _ in range(2)]
    claimed: list[list[int]] = [[], []]
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        barrier.wait()
        claimed[i] = [c.id for c in replicas[i].claim()]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for d in replicas:
        d.close()
    a, b = set(claimed[0]), set(claimed[1])
    assert not a & b  # SKIP LOCKED on PostgreSQL, one writer at a time on SQLite
    assert len(a | b) == 40
