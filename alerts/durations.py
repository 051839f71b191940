"""Parse durations such as "90s", "5m", "1h", "7d" (YAML configs use them)."""

from __future__ import annotations

import re

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(value: object) -> float:
    """Return seconds for a number (seconds) or a string like "5m"; raise ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 5m, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"must not be negative, got {value!r}")
        return float(value)
    if isinstance(value, str):
        m = _RE.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    raise ValueError(f"expected a duration such as 90s, 5m, 1h or 7d, got {value!r}")
