"""Replay a sample of real requests on the reference path, off the request thread.

`offer` runs on the request thread and never waits: it draws against
`quality.traffic_sample_share` and puts the request on a bounded queue, or counts a drop
when the queue is full. One background thread (concurrency 1) replays queued requests on
the reference path (engine.protocol.REFERENCE), compares the served output with the
reference output (probes.quality) and stores one `output_agreements` row of source
"traffic" per request through the Writer: bucket, path, decoding and cohort, never the
text unless `quality.store_text` is on.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from sqlalchemy.orm import Session

from engine.errors import Overloaded
from engine.protocol import REFERENCE, Engine, GenerateResult
from probes.quality import Compared, compare, prompt_key, summarize
from probes.reference import agreement_row
from storage.models import OutputAgreement
from storage.writer import Writer
from vocab import Source, Variant, utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerStats:
    """Counters since start: offered (drawn into the sample), replayed, dropped (queue full,
    closed, or the replay shed by admission for real traffic), failed (the reference call
    raised otherwise)."""

    offered: int
    replayed: int
    dropped: int
    failed: int
    pending: int


@dataclass(frozen=True)
class _Item:
    engine: Engine
    text: str
    max_new_tokens: int | None
    served: GenerateResult
    at: datetime


def _add(session: Session, row: OutputAgreement) -> None:
    session.add(row)


class TrafficSampler:
    """Replay a share of real requests on the reference path in one background thread.

    Example:
        sampler = TrafficSampler(writer, share=0.01, queue_max=16, instance_id="a")
        sampler.offer(engine, text, max_new_tokens, result)   # on the request thread
        sampler.close()
    """

    def __init__(self, writer: Writer | None, *, share: float, queue_max: int,
                 instance_id: str, store_text: bool = False, timeout_s: float = 120.0,
                 rng: random.Random | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"quality.traffic_sample_share: must be in [0, 1], got {share}")
        if queue_max < 1:
            raise ValueError(f"quality.sample_queue_max: must be >= 1, got {queue_max}")
        self.writer = writer
        self.share = share
        self.instance_id = instance_id
        self.store_text = store_text
        self.timeout_s = timeout_s
        self.clock = clock
        self._rng = rng or random.Random()
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=queue_max)
        self._lock = threading.Lock()
        self._offered = self._replayed = self._dropped = self._failed = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> SamplerStats:
        """Return the counters (see SamplerStats)."""
        with self._lock:
            return SamplerStats(self._offered, self._replayed, self._dropped, self._failed,
                                self._queue.qsize())

    def offer(self, engine: Engine, text: str, max_new_tokens: int | None,
              served: GenerateResult) -> bool:
        """Queue `served` for a reference replay when drawn; never blocks. Return if queued."""
        if served.canary or self.share <= 0.0:
            return False
        with self._lock:
            if self._rng.random() >= self.share:
                return False
            self._offered += 1
            if self._closed:
                self._dropped += 1
                return False
            try:
                self._queue.put_nowait(_Item(engine, text, max_new_tokens, served, self.clock()))
            except queue.Full:
                self._dropped += 1
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="quality-sampler",
                                                daemon=True)
                self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._replay(item)
            except Overloaded as e:
                # Synthetic load is shed first by design: a replay refused while real
                # requests wait is dropped, not a failure (no traceback per refusal).
                log.debug("reference replay shed: %s", e)
                with self._lock:
                    self._dropped += 1
            except Exception:  # noqa: BLE001 - one failed replay must not stop the worker
                log.warning("reference replay failed", exc_info=True)
                with self._lock:
                    self._failed += 1
            else:
                with self._lock:
                    self._replayed += 1

    def _replay(self, item: _Item) -> None:
        info = item.engine.info
        ref = item.engine.generate(item.text, max_new_tokens=item.max_new_tokens, canary=True,
                                   override=REFERENCE, timeout_s=self.timeout_s)
        s = item.served
        key = prompt_key(item.text, item.max_new_tokens)
        (group,) = summarize([Compared(key, s.bucket, s.path, s.decoding,
                                       Variant.OPTIMIZED.value,
                                       compare(s.output_ids, ref.output_ids))])
        if self.writer is None:
            return
        row = agreement_row(group, at=item.at, source=Source.TRAFFIC.value,
                            instance_id=self.instance_id, model_version=info.model_version,
                            config_hash=info.config_hash)
        if self.store_text:
            row.text = s.text
        self.writer.submit(partial(_add, row=row))

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests; let the worker finish the one it runs (queued ones drop)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            while True:
                try:
                    if self._queue.get_nowait() is not None:
                        self._dropped += 1
                except queue.Empty:
                    break
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
