"""What every demo step shares: the service, the traffic, the receiver, timed checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from monitor.demo.client import ServiceClient
from monitor.demo.engine import Int8Rollout, SlowableEngine
from monitor.demo.errors import CheckFailed
from monitor.demo.narration import Narrator
from monitor.demo.profile import DemoProfile
from monitor.demo.traffic import TrafficGenerator
from monitor.loopback import WebhookReceiver

Probe = Callable[[], tuple[bool, str]]
# A paced wait also gives up when its cycles took this many times the measured cycle
# time (probes that stop finishing must not hang the demo).
HARD_CAP_CYCLES = 3.0


def epoch(iso: str | None) -> float:
    """Return an API timestamp as time.time() seconds (0 for None)."""
    if not iso:
        return 0.0
    at = datetime.fromisoformat(iso)
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


@dataclass
class StepContext:
    """What every step reads and the events the current step has recorded."""

    profile: DemoProfile
    api: ServiceClient
    traffic: TrafficGenerator
    receiver: WebhookReceiver
    engine: Callable[[], SlowableEngine | None]
    say: Narrator
    run_report: Callable[[], tuple[str, str]]
    rollout: Callable[[], Int8Rollout | None] = lambda: None
    step_name: str = ""
    headline: str = ""
    events: list[str] = field(default_factory=list)
    memo: dict[str, Any] = field(default_factory=dict)

    def event(self, text: str) -> None:
        """Keep a line for the summary and print it."""
        self.events.append(text)
        self.say.say(text)

    def wait_for(self, check: str, expected: str, probe: Probe, timeout_s: float) -> str:
        """Poll `probe` until it holds; raise CheckFailed (expected vs seen) at the timeout."""
        deadline = time.monotonic() + timeout_s
        return self.wait_until(check, expected, probe, lambda: deadline - time.monotonic())

    def wait_progress(self, check: str, expected: str, probe: Probe, stall_s: float) -> str:
        """Poll `probe` until it holds; raise CheckFailed once what it reports stood still
        for `stall_s` (a slow machine takes longer per step; only a stuck wait fails)."""
        mark: dict[str, Any] = {"seen": None, "at": time.monotonic()}

        def tracked() -> tuple[bool, str]:
            ok, seen = probe()
            if seen != mark["seen"]:
                mark.update(seen=seen, at=time.monotonic())
            return ok, seen

        return self.wait_until(check, expected, tracked,
                          lambda: stall_s - (time.monotonic() - mark["at"]))

    def wait_cycles(self, check: str, expected: str, probe: Probe, cycles: int,
                    min_s: float) -> str:
        """Poll `probe` until it holds, for at least `min_s` and `cycles` canary cycles.

        Canary rules judge cycles, so on a loaded machine, where a cycle takes longer, the
        wait lasts as many cycles rather than as many seconds: it fails once `min_s` has
        passed and `cycles` cycles have finished without the condition, or after
        HARD_CAP_CYCLES x `cycles` x the measured cycle time if cycles stop finishing.
        """
        start_wall, start = time.time(), time.monotonic()
        paced = {"finished": 0, "period": self.profile.probe_interval_s}

        def left() -> float:
            try:
                paced["finished"], period = self.cycle_stats(start_wall)
                paced["period"] = period or paced["period"]
            except (httpx.HTTPError, KeyError, ValueError):
                pass  # keep the last reading; the condition's probe reports the error
            elapsed = time.monotonic() - start
            cap = max(min_s, HARD_CAP_CYCLES * cycles * paced["period"])
            if paced["finished"] < cycles and elapsed < cap:
                # Cycles still owed: the time left is what they take at the measured pace.
                return max(min_s - elapsed,
                           (cycles - paced["finished"]) * paced["period"], 0.001)
            return min_s - elapsed

        return self.wait_until(check, expected, probe, left)

    def cycle_stats(self, since: float) -> tuple[int, float | None]:
        """Return (canary cycles finished since `since`, median seconds between cycle starts)."""
        runs = self.api.probe_cycles(limit=50)
        n = sum(1 for r in runs if r.get("finished_at") and epoch(r["finished_at"]) >= since)
        starts = sorted(epoch(r["started_at"]) for r in runs)[-9:]
        gaps = sorted(b - a for a, b in zip(starts, starts[1:], strict=False))
        return n, (gaps[len(gaps) // 2] if gaps else None)

    def cycle_seconds(self) -> float | None:
        """Return the median duration of the latest finished canary cycles (None: none yet)."""
        took = sorted(epoch(r["finished_at"]) - epoch(r["started_at"])
                      for r in self.api.probe_cycles(limit=9) if r.get("finished_at"))
        return took[len(took) // 2] if took else None

    def wait_until(self, check: str, expected: str, probe: Probe,
                   left_s: Callable[[], float]) -> str:
        """Poll `probe` until it holds; raise CheckFailed once `left_s()` (asked after each
        poll, so it may follow what the probe saw) is <= 0."""
        seen = "nothing yet"
        while True:
            try:
                ok, seen = probe()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                ok, seen = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.say.ok(check, seen)
                return seen
            left = left_s()
            if left <= 0:
                self.say.fail(check, expected, seen)
                raise CheckFailed(self.step_name, check, expected, seen)
            self.say.waiting(f"{check} [{seen}] ({left:.0f}s left)")
            time.sleep(0.5)

    def expect(self, check: str, expected: str, ok: bool, seen: str) -> None:
        """Check something that must already hold."""
        self.wait_for(check, expected, lambda: (ok, seen), 0)

    def labels(self) -> tuple[str, ...]:
        """Return the profile's bucket labels."""
        return self.profile.labels


def order(buckets: Any) -> list[str]:
    """Return bucket labels in numeric order ("overflow" last)."""
    return sorted(buckets, key=lambda b: (not str(b).isdigit(), int(b) if str(b).isdigit() else 0,
                                          str(b)))


def firing(ctx: StepContext, rule: str) -> list[dict[str, Any]]:
    return [a for a in ctx.api.alerts("firing") if a["rule"] == rule]
