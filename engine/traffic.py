"""Requests per bucket, this run and earlier runs: the warm-up compiles the busiest first."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path


class BucketTraffic:
    """Count requests per bucket label; read and write the counts under the cache root."""

    def __init__(self, cache_root: Path) -> None:
        self._file = cache_root / "bucket-traffic.json"
        self._lock = threading.Lock()
        self._now: dict[str, int] = {}
        self.before: dict[str, int] = {}

    def load(self) -> None:
        """Read the earlier runs' counts (none: warm in ascending order)."""
        try:
            data = json.loads(self._file.read_text())
            self.before = {str(k): int(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            self.before = {}  # no earlier run (or an unreadable file)

    def count(self, label: str) -> None:
        """Count one request in bucket `label`."""
        with self._lock:
            self._now[label] = self._now.get(label, 0) + 1

    def order(self, edges: Sequence[int]) -> list[int]:
        """Return the bucket edges busiest first (by the earlier runs), then ascending."""
        share = self.before
        return sorted(edges, key=lambda e: (-share.get(str(e), 0), e))

    def save(self) -> None:
        """Write this run's counts merged with the earlier runs' (recent runs weigh more)."""
        with self._lock:
            if not self._now:
                return
            merged = {label: count // 2 for label, count in self.before.items()}
            for label, count in self._now.items():
                merged[label] = merged.get(label, 0) + count
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            self._file.write_text(json.dumps(merged, sort_keys=True))
        except OSError:
            pass  # the order is an optimization; a read-only cache dir only loses it
