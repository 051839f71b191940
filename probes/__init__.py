"""Canary probes, burst probes and real-traffic rollups.

Talks to the model only through `engine.protocol` (no torch). Measurements are
frozen dataclasses (`probes.cycle.CycleResult`, `probes.burst.BurstResult`,
`probes.traffic` rollups); `probes.sink` turns them into storage rows, which the
`storage.writer.Writer` stores (retrying while the database is down).

Exceptions (probes.errors):

ProbeError
 └── SuiteError (also ValueError): a canary suite file is invalid; names field and file

Engine failures and hung calls are not raised: a cycle reports them as its status
("error", "timeout"), and bad arguments raise ValueError naming the setting.
"""

from __future__ import annotations

from probes.errors import ProbeError, SuiteError

__all__ = ["ProbeError", "SuiteError"]
