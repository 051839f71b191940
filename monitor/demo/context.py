"""What every demo step shares: the service, the traffic, the receiver, timed checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from monitor.demo.client import ServiceClient
from monitor.demo.engine import SlowableEngine
from monitor.demo.errors import CheckFailed
from monitor.demo.narration import Narrator
from monitor.demo.profile import DemoProfile
from monitor.demo.receiver import WebhookReceiver
from monitor.demo.traffic import TrafficGenerator

Probe = Callable[[], tuple[bool, str]]


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
        seen = "nothing yet"
        while True:
            try:
                ok, seen = probe()
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                ok, seen = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.say.ok(check, seen)
                return seen
            left = deadline - time.monotonic()
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
