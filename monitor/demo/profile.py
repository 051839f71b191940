"""Demo profiles and the accelerated settings, rules and policy each one runs with.

Shipped defaults are untouched: the demo writes its own rule and policy files (which
replace the shipped entries of the same name) into its work directory and builds a
`Settings` object for the service. Two limits set the pace:

* Canary rules use `window_s`-second cycles (a few seconds) and short baselines. A
  probe cycle's rows are stamped with its start, so a probe cycle that outlasts a rule
  cycle is never in the newest finished rule cycle when the evaluator reads it: the rule
  sees "empty window" on every evaluation. The slowed probe cycle of the latency step
  must therefore fit in a rule cycle (`steps.regression_delay` checks it).
* Traffic rules cannot go below one minute: real traffic is stored as per-minute rollups
  (`storage.rollups.RollupKey` truncates to the minute), so the acceptance alert needs
  two whole minutes of shifted traffic, shifted at a minute's start. That step dominates
  the demo's run time.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alerts.settings import IncidentSettings
from monitor.settings import (
    AlertSettings,
    ApiSettings,
    ApiToken,
    EngineSettings,
    ProbeSettings,
    ReportSettings,
    SchedulerSettings,
    Settings,
    WorkerSettings,
)

OPERATOR = "oncall-alice"
RECEIVER_NAME = "demo-receiver"
# The demo latency rule's `for` and CUSUM min_cycles (the waits are sized from them).
DEMO_FOR = 2
# The server gives a probe cycle this long; the report step's A/B cycles are the longest.
AB_CYCLE_TIMEOUT_S = 240.0
DEMO_CUSUM_CYCLES = 2


@dataclass(frozen=True)
class DemoProfile:
    """How big and how fast the demo runs.

    window_s: cycle length of the canary rules; probes run every probe_interval_s, so
        each rule cycle holds about window_s / probe_interval_s canary cycles.
    canaries_per_bucket: canaries per bucket per probe cycle: 2, the samples a p50 needs,
        so every rule cycle with one probe cycle in it can be judged on its own.
    delay_s: latency injected into every engine call during the regression step.
    shift_bucket: the bucket whose real traffic moves to the shifted domain.
    int8_bucket: the bucket a faulty int8 build is rolled out to in the quality step.
    compile_backend: torch.compile backend. "eager" keeps dynamo's graphs, guards and
        recompile counters real while skipping inductor's code generation, which costs
        minutes per shape on a 2-core CPU (the shape-churn step compiles many shapes).
    """

    name: str
    buckets: tuple[int, ...]
    canaries_per_bucket: int
    probe_interval_s: float
    window_s: float
    min_baseline_cycles: int
    delay_s: float
    traffic_rate_per_s: float
    shift_bucket: int = 32
    int8_bucket: int = 64
    compile_backend: str = "eager"
    warmup_timeout_s: float = 240.0  # without a bucket getting warm (wait_progress)
    baseline_timeout_s: float = 150.0
    # acceptance_drop reads minute rollups and fires on `for` = 2 whole minutes of shifted
    # traffic (the shift starts at a minute's start), judged after each minute's flush and
    # an evaluation: 300 s leaves an evaluation that runs late on a loaded machine room.
    shift_timeout_s: float = 300.0
    # Once the shifted bucket's alert is pending it fires after one more minute cycle,
    # evaluated by a worker that runs late on a loaded machine: the wait lasts this long
    # after the alert went pending, even past shift_timeout_s.
    shift_pending_s: float = 240.0
    regression_timeout_s: float = 90.0
    churn_timeout_s: float = 120.0
    report_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.shift_bucket not in self.buckets:
            raise ValueError(f"shift_bucket: {self.shift_bucket} is not one of {self.buckets}")
        if self.int8_bucket not in self.buckets:
            raise ValueError(f"int8_bucket: {self.int8_bucket} is not one of {self.buckets}")
        if self.window_s < 2 * self.probe_interval_s:
            raise ValueError("window_s: must hold at least two probe intervals")

    @property
    def per_window(self) -> int:
        """Return the canary cycles one rule cycle holds at the nominal pace."""
        return max(1, round(self.window_s / self.probe_interval_s))

    @property
    def baseline_cycles(self) -> int:
        """Return the canary cycles a baseline of min_baseline_cycles windows takes, doubled."""
        return 2 * (self.min_baseline_cycles + 1) * self.per_window

    @property
    def regression_cycles(self) -> int:
        """Return the canary cycles a canary-judged wait lasts at least (StepContext.wait_cycles).

        Firing or resolving takes about (for + cusum min_cycles + 2) rule cycles of
        per_window canary cycles each; doubled, so a slow machine gets more seconds, not
        fewer chances.
        """
        return 2 * (DEMO_FOR + DEMO_CUSUM_CYCLES + 2) * self.per_window

    @property
    def labels(self) -> tuple[str, ...]:
        """Return the bucket labels as the engine names them."""
        return tuple(str(b) for b in self.buckets)


# Two canaries per bucket (and past the largest): the p50 rule judges each rule cycle on
# its own samples (pool: 1), and a p50 needs 2. During the injected slowdown the probe
# cycle (every canary + the delay each) should still fit in a rule cycle, so that every
# rule cycle holds a slowed one (monitor.demo.steps.regression_delay).
FULL = DemoProfile(name="full", buckets=(16, 32, 64, 128, 256), canaries_per_bucket=2,
                   probe_interval_s=3.0, window_s=15.0, min_baseline_cycles=5, delay_s=0.8,
                   traffic_rate_per_s=3.0)
FAST = DemoProfile(name="fast", buckets=(16, 32, 64), canaries_per_bucket=2,
                   probe_interval_s=2.5, window_s=10.0, min_baseline_cycles=5, delay_s=0.8,
                   traffic_rate_per_s=3.0)


def demo_rules(profile: DemoProfile) -> dict[str, Any]:
    """Return the rule overrides (same names as the shipped rules, accelerated)."""
    w = f"{profile.window_s:g}s"
    return {"rules": [
        # The median, not the p99: a demo rule cycle holds a few canaries per bucket, and
        # a p99 needs 100 samples (pooling 50 cycles would outlast the step). A p50 needs
        # 2, which every probe cycle brings: judged on each cycle's own (pool: 1), never on
        # values that repeat earlier cycles' samples.
        {"name": "canary_latency_regression",
         "description": "Canary median latency per bucket rose against its baseline (demo pace).",
         "metric": "p50_latency", "source": "canary", "per": ["bucket"],
         # Wide band: a machine shared with other work moves canary latency for minutes;
         # the injected slowdown stays well past this band (DELAY_PER_BASELINE).
         "change": "+200%", "resolve_change": "+100%", "for": DEMO_FOR, "resolve_for": 2,
         "min_samples": 1, "window": w, "lookback": 12, "baseline_window": "30m",
         "min_baseline_cycles": profile.min_baseline_cycles,
         "cusum": {"min_cycles": DEMO_CUSUM_CYCLES}, "pool": 1, "severity": "page"},
        # The shipped floor (0.99: float32 optimizations are exact here) at demo pace.
        {"name": "output_agreement_drop",
         "description": "The optimized canaries' outputs in a bucket stopped matching the "
                        "reference path (demo pace).",
         "metric": "output_agreement", "source": "canary", "per": ["bucket", "variant"],
         "match": {"variant": "optimized"}, "change": "-2%", "resolve_change": "-0.5%",
         "for": DEMO_FOR, "resolve_for": 2, "min_samples": 1, "floor": 0.99, "window": w,
         "lookback": 12, "baseline_window": "30m",
         "min_baseline_cycles": profile.min_baseline_cycles, "severity": "page"},
        {"name": "acceptance_drop",
         "description": "Real-traffic acceptance per bucket fell (demo pace; minute rollups).",
         "metric": "acceptance_rate", "source": "traffic", "per": ["bucket"],
         "change": "-40%", "resolve_change": "-15%", "for": 2, "resolve_for": 2,
         "min_samples": 3, "window": "1m", "lookback": 5, "baseline_window": "30m",
         "min_baseline_cycles": 1, "cusum": {"min_cycles": 2, "min_spread_rel": 0.1},
         "severity": "page"},
        {"name": "recompiles_per_hour",
         "description": "torch.compile keeps recompiling (demo pace).",
         "metric": "recompiles_per_hour", "source": "canary", "per": ["instance"],
         "change": "+100%", "for": 2, "ceiling": 2, "window": w, "lookback": 12,
         "baseline_window": "30m", "min_baseline_cycles": profile.min_baseline_cycles,
         "severity": "page"},
    ]}


def demo_policy() -> dict[str, Any]:
    """Return the policy overrides: long holds (no restore mid-demo), no automatic revert."""
    return {
        "policies": [
            {"name": "speculation_off_on_acceptance_drop", "alerts": ["acceptance_drop"],
             "flag": "speculative", "scope_from": "bucket", "value": False,
             "probation": 0.1, "expires": "1h", "hold": "30m", "cooldown": "30m",
             "recovery": {"measure": "probation_acceptance", "window": "2m",
                          "min_samples": 40, "within": "-10%", "floor": 0.5}},
            {"name": "eager_on_compile_trouble",
             "alerts": ["recompiles_per_hour", "compile_failures"],
             "flag": "compiled", "value": False, "expires": "1h", "hold": "30m",
             "cooldown": "30m",
             "recovery": {"measure": "canary_variant", "variant": "compiled", "window": "2m",
                          "min_samples": 4, "within": "+0%"}},
        ],
        # The scripted latency regression follows the automatic speculation change by
        # a minute; the shipped revert rule would (rightly) undo it. Off for the demo.
        "revert": {"alerts": []},
    }


def demo_settings(profile: DemoProfile, workdir: Path, *, receiver_url: str,
                  report_dir: Path, token: str | None = None) -> Settings:
    """Write the rule and policy files into `workdir` and return the service settings."""
    workdir.mkdir(parents=True, exist_ok=True)
    rules_file = workdir / "demo-rules.yaml"
    policy_file = workdir / "demo-policy.yaml"
    rules_file.write_text(yaml.safe_dump(demo_rules(profile), sort_keys=False))
    policy_file.write_text(yaml.safe_dump(demo_policy(), sort_keys=False))
    return Settings(
        database_url=f"sqlite:///{(workdir / 'tailwatch-demo.db').resolve()}",
        auto_migrate=True,
        instance_id="demo",
        engine=EngineSettings(
            buckets=profile.buckets, compile_mode="default",
            compile_backend=profile.compile_backend, num_threads=1,
            # Loaded, served nowhere until the quality step rolls it out to one bucket
            # (demo.engine.Int8Rollout); the demo builds it faulty (noisy weights).
            quantization="int8",
            # The engine's own fallback (engine.speculative_fallback) would stop
            # speculating in the shifted bucket within seconds, leaving the acceptance rule
            # too few speculative requests per minute to judge: off, so the step shows the
            # monitored path (alert, policy flag, webhook).
            speculative_fallback=False,
            # Two decode streams: canaries do not queue behind real traffic.
            max_concurrency=2, max_queue=16,
            cache_dir=str(Path("var/compile-cache").resolve())),
        probes=ProbeSettings(canaries_per_bucket=profile.canaries_per_bucket,
                             # Scheduled cycles run no A/B arms, so the steps that
                             # count cycles keep their pace; the report step runs A/B
                             # cycles itself. Never `exact`: it would compile the exact
                             # shapes the shape-churn step is meant to discover.
                             ab_share=0.0, ab_arms=("eager", "direct"),
                             # The report step's A/B cycles run every prompt three times
                             # (the eager arm the slowest): on a loaded box they take
                             # minutes, which slows the demo rather than failing it.
                             cycle_timeout_s=AB_CYCLE_TIMEOUT_S),
        scheduler=SchedulerSettings(
            probe_interval_s=profile.probe_interval_s, burst_interval_s=0,
            evaluate_interval_s=1.0, delivery_interval_s=0.5,
            traffic_flush_interval_s=1.0, misfire_grace_s=5),
        alerts=AlertSettings(
            rules_file=str(rules_file), policy_file=str(policy_file),
            webhooks=[{"name": RECEIVER_NAME, "url": receiver_url, "format": "alertmanager",
                       "timeout": 2}],
            # Canaries only start once every bucket is compiled: no warm-in to skip.
            baseline_refresh_s=3600.0, baseline_warm_in_s=0.0,
            resend_interval_s=3600.0, flags_ttl_s=0.5,
            # Steps check each bucket's alert at the receiver within seconds: an incident's
            # members that join or resolve later arrive as updates, so no 5-minute wait.
            incidents=IncidentSettings(group_interval_s=1.0)),
        api=ApiSettings(auth=True, read_auth=False,
                        tokens=[ApiToken(name=OPERATOR,
                                         token=token or secrets.token_urlsafe(24))]),
        report=ReportSettings(out_dir=str(report_dir)),
        # The analysis runs in a worker child as under `serve` (demo.server.AnalysisProcess);
        # its /healthz and /metrics on any free port. At nice 0, not the shipped 10: on
        # SQLite the evaluation records in a write transaction, and a worker niced on a
        # saturated host (a CI runner) held the write lock for many seconds an evaluation,
        # so the serving process's traffic rows, and the demo's alerts on them, came late
        # (docs/operations.md, "SQLite's write lock").
        worker=WorkerSettings(port=0, nice=0),
    )
