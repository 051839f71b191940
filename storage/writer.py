"""Background writes that a down or locked database delays but never loses.

Callers `submit(fn)` a callable taking a Session; one thread runs queued
callables in batches, one transaction per batch, and retries a batch with
exponential backoff while the database is unreachable or locked. The queue is
bounded: when full, `submit` refuses the item and counts it as dropped (the only
way an item is lost, besides submitting after `close`, and both are counted in
`stats.dropped`). Errors that a retry cannot cure (a bug, bad data, a constraint
violation) discard only the offending item, counted in `stats.failed`.

Exactly once: each batch carries a token (a UUID drawn once, kept across its retries)
inserted first in its transaction into `applied_batches`. When the connection is lost
after COMMIT was sent, the writer cannot tell whether the batch committed; the retry's
token insert then conflicts if it did (on PostgreSQL it waits for a commit still in
progress), and the batch is skipped, counted in `stats.already_applied`, instead of
being written twice.

Example:
    writer = Writer(sessionmaker)
    writer.submit(lambda s: s.add(MemorySample(...)))
    writer.flush(timeout=5)
    writer.close()
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, insert
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from storage.errors import InvalidQuery
from storage.models import AppliedBatch
from vocab import utcnow

log = logging.getLogger(__name__)

WriteFn = Callable[[Session], object]

# Tokens of batches known committed are deleted this many at a time, with a later batch:
# a token matters only while its own batch may be retried.
TOKENS_KEPT = 64
# Core statements on the session's connection: the ORM layer would cost more per batch
# than the insert itself.
_INSERT_TOKEN = insert(AppliedBatch)
_DELETE_TOKENS = delete(AppliedBatch).where(
    AppliedBatch.token.in_(bindparam("tokens", expanding=True)))


@dataclass(frozen=True)
class WriterStats:
    """Counters since the writer started.

    pending: queued or being written; written: committed; retries: failed
    attempts that will be retried; dropped: refused because the queue was full;
    failed: items that raised a non-transient error (a bug or bad data) and were
    discarded after being isolated from their batch; already_applied: batches a retry
    found committed by an attempt that had lost its connection (their items count in
    `written` once).
    """

    pending: int
    written: int
    retries: int
    dropped: int
    failed: int
    last_error: str | None
    already_applied: int = 0


def is_transient(error: BaseException) -> bool:
    """Return True for errors a later retry may cure (connection lost, database locked)."""
    if isinstance(error, sa_exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError)


class Writer:
    """Run submitted write callables on a background thread with retry and backoff."""

    def __init__(
        self,
        sessionmaker: sessionmaker[Session],
        *,
        max_pending: int = 10_000,
        batch_size: int = 200,
        initial_backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        name: str = "storage-writer",
    ) -> None:
        if max_pending < 1:
            raise InvalidQuery("max_pending", f"must be at least 1, got {max_pending}")
        if batch_size < 1:
            raise InvalidQuery("batch_size", f"must be at least 1, got {batch_size}")
        self._sessionmaker = sessionmaker
        self._max_pending = max_pending
        self._batch_size = batch_size
        self._initial_backoff = initial_backoff_s
        self._max_backoff = max_backoff_s
        self._queue: deque[WriteFn] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._written = self._retries = self._dropped = self._failed = 0
        self._already_applied = 0
        self._last_error: str | None = None
        # Tokens of batches known committed (writer thread only), deleted in bulk.
        self._committed_tokens: list[str] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: WriteFn) -> bool:
        """Queue `fn` to run in a write transaction; return False if it was dropped."""
        with self._cond:
            if self._closing:
                # A job still running at shutdown: count it rather than raise in its thread.
                self._dropped += 1
                log.warning("storage writer closed: dropped a late write")
                return False
            if len(self._queue) + self._in_flight >= self._max_pending:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning("storage writer full (%d pending): dropped %d items so far",
                                self._max_pending, self._dropped)
                return False
            self._queue.append(fn)
            self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; return False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float | None = 10.0) -> int:
        """Flush for up to `timeout`, stop the thread and return the items left unwritten."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, self._max_backoff) + 1.0)
        with self._cond:
            return len(self._queue) + self._in_flight

    @property
    def stats(self) -> WriterStats:
        """Return the current counters."""
        with self._cond:
            return WriterStats(
                pending=len(self._queue) + self._in_flight, written=self._written,
                retries=self._retries, dropped=self._dropped, failed=self._failed,
                last_error=self._last_error, already_applied=self._already_applied,
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing and drained
                batch = [self._queue.popleft()
                         for _ in range(min(self._batch_size, len(self._queue)))]
                self._in_flight = len(batch)
            done = self._write_with_retry(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()
                if not done:
                    return  # closed while the database was down

    def _write_with_retry(self, batch: list[WriteFn]) -> bool:
        """Write `batch`; return False if it was put back because the writer is closing."""
        token = uuid.uuid4().hex  # the same for every retry of this batch
        backoff = self._initial_backoff
        while True:
            try:
                self._write(batch, token)
                return True
            except Exception as error:
                if not is_transient(error):
                    return self._isolate(batch, error)
                with self._cond:
                    self._retries += 1
                    self._last_error = _one_line(error)
                    if self._closing:
                        # Stop retrying on close; leave the batch counted as pending.
                        self._queue.extendleft(reversed(batch))
                        return False
                    log.warning("storage write failed (retry in %.2fs): %s", backoff,
                                self._last_error)
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)

    def _write(self, batch: list[WriteFn], token: str) -> None:
        done = self._committed_tokens
        stale = done if len(done) >= TOKENS_KEPT else []
        try:
            with self._sessionmaker.begin() as session:
                _record(session, token, stale)
                for fn in batch:
                    fn(session)
        except _AlreadyApplied:
            with self._cond:
                self._already_applied += 1
                self._written += len(batch)
            log.warning("storage writer: batch already applied (%d writes): an attempt whose "
                        "connection was lost had committed it; not written again", len(batch))
        else:
            with self._cond:
                self._written += len(batch)
        # Committed either way, and with it the deletion of the stale tokens.
        if stale:
            self._committed_tokens = [token]
        else:
            done.append(token)

    def _isolate(self, batch: list[WriteFn], error: BaseException) -> bool:
        """Write a failed batch item by item so one bad item does not sink the others."""
        if len(batch) == 1:
            with self._cond:
                self._failed += 1
                self._last_error = _one_line(error)
            log.error("storage write discarded: %s", _one_line(error))
            return True
        for i, fn in enumerate(batch):
            if not self._write_with_retry([fn]):
                with self._cond:
                    self._queue.popleft()  # fn, put back by the retry: keep the order
                    self._queue.extendleft(reversed(batch[i:]))
                return False
        return True


class _AlreadyApplied(Exception):
    """The batch's token is recorded: an earlier attempt of this batch committed."""


def _record(session: Session, token: str, stale: list[str]) -> None:
    """Insert the batch's token, first in its transaction; delete the writer's `stale` ones.

    Raises _AlreadyApplied (rolling the transaction back) when the token is there.
    """
    connection = session.connection()
    try:
        connection.execute(_INSERT_TOKEN, {"token": token, "applied_at": utcnow()})
    except sa_exc.IntegrityError as exc:
        raise _AlreadyApplied(token) from exc
    if stale:
        # Committed, and this writer has moved past them: no retry can need them again.
        connection.execute(_DELETE_TOKENS, {"tokens": stale})


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
