"""`tailwatch demo`: the whole monitoring loop on this machine, scripted and checked.

Starts the service on a loopback port with a throw-away SQLite database, the built-in
models and accelerated schedules, plus a loopback webhook receiver, then plays a
scenario (baseline, latency regression, a faulty int8 build in one bucket, shape churn,
operator override, traffic shift, weekly report) and checks each step's outcome through
the public API.

Exceptions:

    DemoError                 the demo could not run as scripted
    ├── CheckFailed           a step's check timed out (carries expected vs seen)
    └── DemoSetupError        the service, receiver or models could not start
    DemoOptionError(ValueError)  a bad option (names the field)
"""

from __future__ import annotations

from monitor.demo.errors import CheckFailed, DemoError, DemoOptionError, DemoSetupError
from monitor.demo.outcome import DemoOutcome, StepResult
from monitor.demo.profile import FAST, FULL, DemoProfile
from monitor.demo.scenario import DemoOptions, run_demo

__all__ = [
    "FAST",
    "FULL",
    "CheckFailed",
    "DemoError",
    "DemoOptionError",
    "DemoOptions",
    "DemoOutcome",
    "DemoProfile",
    "DemoSetupError",
    "StepResult",
    "run_demo",
]
