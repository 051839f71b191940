"""KV and memory accounting: the bytes the caches and the running requests hold."""

from __future__ import annotations

import threading
from typing import Any

import torch

from engine.protocol import MemorySnapshot


class KvAccount:
    """Count the KV bytes of tensors actually allocated: the static buffers (each row's
    self-attention caches and, batched on a compiled step, the fixed-row step's scratch row
    and each row's padded cross K/V: engine.row_buffers) and each running request's
    cross-attention K/V; thread-safe."""

    def __init__(self, static_bytes: int) -> None:
        self._lock = threading.Lock()
        self.static = static_bytes
        self._running = 0
        self._request_peak = 0
        self._peak = static_bytes

    def add_static(self, nbytes: int) -> None:
        """Count `nbytes` more of static buffers (allocated on first need)."""
        with self._lock:
            self.static += nbytes
            self._peak = max(self._peak, self.static + self._running)

    def hold(self, nbytes: int, request_bytes: int) -> None:
        """Count `nbytes` more K/V held by a request that now holds `request_bytes` in all."""
        with self._lock:
            self._running += nbytes
            self._request_peak = max(self._request_peak, request_bytes)
            self._peak = max(self._peak, self.static + self._running)

    def release(self, nbytes: int) -> None:
        """Forget `nbytes` of request K/V (its request left)."""
        with self._lock:
            self._running -= nbytes

    def total(self) -> int:
        """Return the KV bytes allocated now: static caches plus running requests' K/V."""
        with self._lock:
            return self.static + self._running

    def fields(self) -> dict[str, int]:
        """Return MemorySnapshot's KV fields."""
        with self._lock:
            return dict(kv_cache_bytes=self.static + self._running,
                        kv_static_bytes=self.static, kv_request_bytes=self._running,
                        kv_request_peak_bytes=self._request_peak, kv_peak_bytes=self._peak)


def memory_snapshot(device: torch.device, kv: KvAccount, weight_bytes: int) -> MemorySnapshot:
    """Return the process's RSS, the KV account, the weights and (on CUDA) the allocator's."""
    import psutil

    rss = psutil.Process().memory_info().rss
    fields = kv.fields()
    if device.type != "cuda":
        return MemorySnapshot(device=str(device), rss_bytes=rss, weight_bytes=weight_bytes,
                              **fields)
    stats = torch.cuda.memory_stats(device)
    return MemorySnapshot(
        device=str(device), rss_bytes=rss, weight_bytes=weight_bytes, **fields,
        cuda_allocated_bytes=int(torch.cuda.memory_allocated(device)),
        cuda_reserved_bytes=int(torch.cuda.memory_reserved(device)),
        cuda_peak_bytes=int(torch.cuda.max_memory_allocated(device)),
        cuda_alloc_retries=int(stats.get("num_alloc_retries", 0)),
        cuda_ooms=int(stats.get("num_ooms", 0)),
    )


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def held_tensors(runners: list[Any]) -> dict[str, int]:
    """Return the bytes of the tensors `runners` (engine.runner.ModelRunner) hold, by label.

    Each storage is counted once, under the first label that reaches it: the model's
    parameters and buffers (`<runner>.<name>`), its bias and position tables
    (`<runner>.tables`) and what its C step keeps beside the weights (`<runner>.c_step`:
    the int8 rows' sums). KV caches and per-thread scratch are working memory, not counted.
    """
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}

    def add(label: str, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in seen or key[1] == 0:
            return
        seen.add(key)
        out[label] = out.get(label, 0) + t.untyped_storage().nbytes()

    for runner in runners:
        m = runner.m
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            add(f"{runner.name}.{name}", t)
        tables = [runner.dec_bias, *runner.tables(), runner.start, *runner.positions,
                  *runner.windows]
        for t in tables:
            add(f"{runner.name}.tables", t)
        native = runner.native
        for t in getattr(native, "_keep", ()):
            if isinstance(t, torch.Tensor):
                add(f"{runner.name}.c_step", t)
    return out
