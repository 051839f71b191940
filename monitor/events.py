"""Log lines an operator acts on: alert transitions, flag changes, from each evaluation.

One INFO line per alert that fires or resolves (rule, labels, change) and per flag the
policy sets or clears (actor "policy", reason); pending alerts and "skip" decisions stay
at DEBUG. Manual flag changes are logged by the flag API with their actor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("tailwatch.events")

_LOUD_STATES = ("firing", "resolved")
_LOUD_ACTIONS = ("set", "restore", "revert", "expire", "probation")


def labels_text(labels: Mapping[str, Any]) -> str:
    """Return labels as `k=v,k=v`, sorted."""
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels)) or "-"


def _change(report: Any, rule: str, labels: Mapping[str, str]) -> str:
    for r in getattr(report, "results", ()):
        if r.rule == rule and dict(r.labels) == dict(labels) and r.relative_change is not None:
            return (f"{r.relative_change:+.1%} ({r.baseline:.4g} -> {r.current:.4g})"
                    if r.baseline is not None and r.current is not None
                    else f"{r.relative_change:+.1%}")
    return "n/a"


def log_evaluation(report: Any) -> None:
    """Log what one `alerts.evaluator.evaluate` report changed."""
    for t in getattr(report, "transitions", ()):
        line = (f"alert {t.alert_id} {t.to_state}: {t.rule} {{{labels_text(t.labels)}}} "
                f"change {_change(report, t.rule, t.labels)}: {t.reason}")
        (log.info if t.to_state in _LOUD_STATES else log.debug)(line)
    for a in getattr(report, "actions", ()):
        alert = f" (alert {a.alert_id})" if a.alert_id is not None else ""
        line = f"flag {a.flag}[{a.scope}] {a.kind} to {a.value!r} by policy{alert}: {a.reason}"
        (log.info if a.kind in _LOUD_ACTIONS else log.debug)(line)


def log_flag_change(action: str, name: str, scope: str, actor: str, reason: str,
                    value: Any = None) -> None:
    """Log a manual flag change with its actor and reason."""
    to = f" to {value!r}" if action == "set" else ""
    log.info("flag %s[%s] %s%s by %s: %s", name, scope, action, to, actor, reason)
