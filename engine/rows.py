"""The decode rows: each row's self-attention caches, and a request encoded and decoded
on its row.

A row is an admission slot: batched, a batch row of the scheduler's loop; unbatched, a
decode stream; and, where synthetic requests are preempted, one more: admission's extra
slot, which a real request decodes on while they pause (batched, while as many synthetic
rows pause as keep a step at max_batch rows). Its caches are allocated once
and reused by every request that holds it (engine.row_buffers: every row's cache a slice
of one tensor per model, and, where the fixed-row compiled step can serve, each row's
padded cross K/V, filled as a request joins); the KV account (engine.memory) counts them
and each running request's cross-attention K/V. `Rows` is what the batching loop needs of
its engine (engine.scheduler.RowOwner); unbatched, `run` decodes a whole request on the
calling (owner) thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine import decoding, group_encode, scheduler
from engine.memory import KvAccount
from engine.models import Models
from engine.row_buffers import RowBuffers
from engine.runner import Fns, ModelRunner


def fns(runner: ModelRunner, key: int | str | None, native: bool = True) -> Fns:
    """Return the functions `runner` decodes with for a request routed to `key`."""
    if key is None:
        return runner.eager
    # The native_step flag off: this request's compiled functions use the compiled
    # step even where the C step is bound (built on first use, kept apart).
    return runner.compiled(key) if native else runner.compiled_step(key)


class Rows:
    """The rows' caches and the KV they hold; thread-safe as long as one request holds a
    row at a time (the admission slot)."""

    def __init__(self, models: Models, *, count: int, device: torch.device,
                 compile_on: bool, batched: bool = False, extra: bool = False) -> None:
        """`batched`: the rows are a batching loop's (engine.scheduler); `extra`: the
        last of the `count` rows is admission's extra slot (a batched step decodes at
        most count - 1 rows)."""
        self.models = models
        self.device = device
        self._compile_on = compile_on
        self._step_rows = count - extra
        with torch.no_grad():
            self.buffers = {r.name: self._new_buffers(r, count, batched)
                            for r in (models.target, models.draft) if r is not None}
        self.caches = [{name: b.caches[row] for name, b in self.buffers.items()}
                       for row in range(count)]
        self.kv = KvAccount(sum(b.nbytes() for b in self.buffers.values()))
        self._batched = batched

    def _new_buffers(self, runner: ModelRunner, count: int, batched: bool) -> RowBuffers:
        models = self.models
        # The fixed-row step serves batched target rows decoded by a compiled step: where
        # a target (float or int8, both on these caches) has no C step. The draft only
        # ever steps one row at a time.
        # (Beside a bound C step, the native_step flag off: fixed_rows() on first use.)
        targets = [r for r in (models.target, models.target_q) if r is not None]
        scratch = batched and self._compile_on and runner is models.target
        fixed = scratch and any(r.native is None for r in targets)
        return RowBuffers(runner.m, rows=count, slots=models.slots,
                          cross_len=max(runner.edges), scratch=scratch, fixed=fixed,
                          # Marked static only for a compiled step (the C step and eager
                          # need no mark).
                          static=self._compile_on and (fixed or runner.native is None),
                          step_rows=self._step_rows)

    def fixed_rows(self) -> RowBuffers | None:
        """Return the target's buffers with the fixed-row step's cross buffers allocated
        (now, and counted, if they were not), or None where rows are not batched."""
        if not (self._batched and self._compile_on):
            return None
        buffers = self.buffers["target"]
        self.kv.add_static(buffers.make_fixed())
        return buffers

    def _target(self, quantized: bool) -> ModelRunner:
        models = self.models
        return models.target_q if quantized and models.target_q is not None else models.target

    def row_room(self, k: int) -> int:
        """Return the most new tokens a batch row's cache holds for a request drafting k."""
        # A step writes position len(tokens) - 1 < max_new; a verification k_max + 1
        # positions from there (its padding included).
        return self.models.slots - (self.models.k_max if k > 0 else 0)

    def group_key(self, job: scheduler.Job) -> tuple[int, int, int, bool] | None:
        """Return what decides `job`'s encoder where arrivals of one key may be encoded
        together (engine.group_encode), None where it encodes alone."""
        target = self._target(job.quantized)
        if not isinstance(job.key, int) or job.length not in target.group_edges:
            return None
        return id(target), job.key, job.length, job.native

    def encode_rows(self, jobs: list[scheduler.Job]) -> list[decoding.Encoded]:
        """Encode the inputs of `jobs` (one group_key) in one call on the calling (loop)
        thread; return each one's target encoder output. Holds nothing: start_row does."""
        job = jobs[0]
        target = self._target(job.quantized)
        with torch.no_grad():
            t_device = time.perf_counter()
            inputs = [self.padded(j.ids, j.length) for j in jobs]
            encoded = group_encode.encode(target, [ids for ids, _ in inputs],
                                          [mask for _, mask in inputs])
        for j in jobs:
            j.t_device = t_device
        return encoded

    def start_row(self, job: scheduler.Job, tenc: decoding.Encoded | None = None
                  ) -> decoding.RowState:
        """Encode `job`'s input on the calling (loop) thread (unless `tenc`: its target
        encoder output, from encode_rows); return its row's decode state."""
        caches = self.caches[job.row]
        target = self._target(job.quantized)
        with torch.no_grad():
            if tenc is None:
                job.t_device = time.perf_counter()
            padded, mask = self.padded(job.ids, job.length)
            tfns = fns(target, job.key, job.native)
            if tenc is None:
                tenc = decoding.encode(target, tfns, padded, mask)
            job.held = tenc.nbytes
            self.kv.hold(job.held, job.held)
            buffers = self.buffers["target"]
            fixed = tfns.rows is not None and buffers.fixed
            if fixed:  # its row of the fixed-row step's cross K/V
                buffers.load(job.row, tenc.cross, tenc.mask_bias)
            if job.k > 0 and self.models.draft is not None:
                row = self._with_draft(job, target, tfns, tenc, padded, mask)
            else:
                row = decoding.RowState(target, tfns, tenc, caches["target"], job.max_new)
            row.buffers = buffers if fixed else None
            job.t_encoded = time.perf_counter()
        return row

    def _with_draft(self, job: scheduler.Job, target: ModelRunner, tfns: Fns,
                    tenc: decoding.Encoded, padded: torch.Tensor, mask: torch.Tensor
                    ) -> decoding.RowState:
        """Return `job`'s row state with its draft, whose encoder runs on first use."""
        caches = self.caches[job.row]
        draft = self.models.draft
        assert draft is not None
        dfns = fns(draft, job.key, job.native)

        def encode_draft() -> decoding.Encoded:
            # Run when the row first speculates (alone in the batch): a row that only ever
            # decodes batched never pays for the draft's encoder.
            denc = decoding.encode(draft, dfns, padded, mask)
            job.held += denc.nbytes
            self.kv.hold(denc.nbytes, job.held)
            return denc

        return decoding.RowState(target, tfns, tenc, caches["target"], job.max_new,
                                 draft=draft, dfns=dfns, denc=encode_draft,
                                 dcache=caches["draft"], k=job.k)

    def kv_release(self, nbytes: int) -> None:
        """Forget `nbytes` of request K/V (a batched request left)."""
        self.kv.release(nbytes)

    def padded(self, ids: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `ids` padded to `length` and its attention mask, on the device."""
        padded = torch.full((1, length), self.models.target.m.pad_id, dtype=torch.long)
        padded[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros((1, length), dtype=torch.long)
        mask[0, : len(ids)] = 1
        return padded.to(self.device), mask.to(self.device)

    def run(self, ids: list[int], length: int, key: int | str | None, slot: int,
            k: int, max_new: int, deadline: float | None, quantized: bool = False,
            native: bool = True, cancel: threading.Event | None = None,
            pause: Callable[[], None] | None = None
            ) -> tuple[decoding.Decoded, float, float]:
        """Encode and decode a request on row `slot` in this thread (unbatched) until done,
        past `deadline` or `cancel` set (`pause`: called at every step boundary, see
        engine.decoding); return what it decoded, when its encoders finished and when its
        input reached the device."""
        caches = self.caches[slot]
        target = self._target(quantized)
        draft = self.models.draft
        with torch.no_grad():
            t_device = time.perf_counter()
            padded, mask = self.padded(ids, length)
            tfns = fns(target, key, native)
            tenc = decoding.encode(target, tfns, padded, mask)
            held = tenc.nbytes
            self.kv.hold(held, held)
            try:
                if k > 0 and draft is not None:
                    dfns = fns(draft, key, native)
                    denc = decoding.encode(draft, dfns, padded, mask)
                    held += denc.nbytes
                    self.kv.hold(denc.nbytes, held)  # the peak is per request: both models
                    t_encoded = time.perf_counter()
                    decoded = decoding.speculative(
                        target, tfns, tenc, caches["target"], draft, dfns, denc,
                        caches["draft"], k, max_new, deadline, cancel=cancel, pause=pause)
                else:
                    t_encoded = time.perf_counter()
                    decoded = decoding.direct(target, tfns, tenc, caches["target"],
                                              max_new, deadline, cancel=cancel, pause=pause)
            finally:
                self.kv.release(held)
        return replace(decoded, kv_request_bytes=held), t_encoded, t_device
