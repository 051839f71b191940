"""The durable flag store the engine reads and the API writes.

Flags (name: scope -> value):
    speculative            "global" or a bucket label ("64", "overflow") -> bool
    compiled               "global" or "instance:<id>" -> bool (False = eager fallback; an
                           instance scope overrides global for that instance only)
    bucketing              "global" -> bool
    quantized              "global" or a bucket label -> bool (False: float32 weights where
                           engine.quantization is int8)
    speculative_probation  "global" -> share in [0, 1] of a disabled bucket's requests
                           that still speculate, so acceptance recovery can be measured
    native_step            "global" or "instance:<id>" -> bool (False: the compiled step)
    batching               "global" or "instance:<id>" -> bool (False: every request runs
                           with no batch-mates, as engine.max_batch 1)

Each (name, scope) may hold a manual and an automatic row; the manual one always wins,
expired rows are ignored (and removed with an audit row by `expire`). Every change
writes a `FlagAudit` row: actor, source, old and new value, reason, time.

Example:
    store = FlagStore()
    with sessions.begin() as s:
        store.set(s, "speculative", "64", False, reason="draft drifts on logs", actor="ana")
    provider = SqlFlagProvider(sessions)      # engine.load_engine(cfg, flags=provider)
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from alerts.errors import AlertsError, FlagError
from engine.protocol import RuntimeFlags
from storage.db import reading
from storage.models import FLAG_SCOPE_GLOBAL, FLAG_SOURCES, Flag, FlagAudit
from storage.queries import flags as queries
from vocab import utcnow

log = logging.getLogger(__name__)

FLAG_NAMES = ("speculative", "compiled", "bucketing", "speculative_probation", "quantized",
              "native_step", "batching")
PER_BUCKET_FLAGS = ("speculative", "quantized")
# Flags that take "global" or one instance's scope ("instance:<id>").
PER_INSTANCE_FLAGS = ("compiled", "native_step", "batching")
_BUCKET_RE = re.compile(r"^(\d{1,6}|overflow)$")
INSTANCE_SCOPE_PREFIX = "instance:"
# flags.scope is 64 characters: the prefix leaves 55 for the instance id.
_INSTANCE_RE = re.compile(r"^instance:[A-Za-z0-9_.:-]{1,55}$")


def instance_scope(instance_id: str) -> str:
    """Return the flag scope of one instance ("instance:<id>")."""
    return f"{INSTANCE_SCOPE_PREFIX}{instance_id}"


def applies_to(scope: str, instance_id: str | None) -> bool:
    """Return whether a flag scope can apply to the engine of `instance_id`.

    Global and bucket scopes apply to every instance; "instance:<id>" only to that one.
    """
    if not scope.startswith(INSTANCE_SCOPE_PREFIX):
        return True
    return instance_id is not None and scope == instance_scope(instance_id)
Clock = Callable[[], datetime]


@dataclass(frozen=True)
class FlagView:
    """One stored flag row."""

    name: str
    scope: str
    value: Any
    source: str
    reason: str | None
    actor: str
    expires_at: datetime | None
    alert_id: int | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class AuditView:
    """One audit row."""

    at: datetime
    name: str
    scope: str
    actor: str
    source: str
    action: str
    old_value: Any
    new_value: Any
    reason: str | None
    alert_id: int | None = None  # the alert an automatic change answered


def validate(name: str, scope: str, value: Any = None, *, check_value: bool = True) -> Any:
    """Return the normalized value of a flag change; raise FlagError naming the field."""
    if name not in FLAG_NAMES:
        raise FlagError("name", f"unknown flag {name!r} (known: {', '.join(FLAG_NAMES)})",
                        value=name)
    if not isinstance(scope, str) or not scope:
        raise FlagError("scope", "must be 'global' or a bucket label", value=scope)
    if name in PER_BUCKET_FLAGS:
        if scope != FLAG_SCOPE_GLOBAL and not _BUCKET_RE.match(scope):
            raise FlagError("scope", f"{name} takes 'global' or a bucket label such as "
                                     f"'64', got {scope!r}", value=scope)
    elif name in PER_INSTANCE_FLAGS:
        if scope != FLAG_SCOPE_GLOBAL and not _INSTANCE_RE.match(scope):
            raise FlagError("scope", f"{name} takes 'global' or 'instance:<id>' (id of at most "
                                     f"55 letters, digits, _.:-), got {scope!r}", value=scope)
    elif scope != FLAG_SCOPE_GLOBAL:
        raise FlagError("scope", f"{name} only has scope 'global', got {scope!r}", value=scope)
    if not check_value:
        return None
    if name == "speculative_probation":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise FlagError("value", f"speculative_probation is a share in [0, 1], got {value!r}",
                            value=value)
        return float(value)
    if not isinstance(value, bool):
        raise FlagError("value", f"{name} takes true or false, got {value!r}", value=value)
    return value


def _view(f: Flag) -> FlagView:
    return FlagView(f.name, f.scope, f.value, f.source, f.reason, f.actor, f.expires_at,
                    f.alert_id, f.created_at, f.updated_at)


class FlagStore:
    """Read and change flags inside the caller's transaction."""

    def __init__(self, clock: Clock = utcnow) -> None:
        self.clock = clock

    def _audit(self, session: Session, at: datetime, name: str, scope: str, actor: str,
               source: str, action: str, old: Any, new: Any, reason: str | None,
               alert_id: int | None) -> None:
        session.add(FlagAudit(at=at, name=name, scope=scope, actor=actor, source=source,
                              action=action, old_value=old, new_value=new, reason=reason,
                              alert_id=alert_id))

    def set(self, session: Session, name: str, scope: str, value: Any, *, reason: str,
            actor: str, source: str = "manual", expires_at: datetime | None = None,
            alert_id: int | None = None) -> FlagView:
        """Set a flag (manual or auto) and audit the change."""
        value = validate(name, scope, value)
        _check_source(source)
        _check_text("reason", reason)
        _check_text("actor", actor)
        now = self.clock()
        if expires_at is not None:
            if expires_at.tzinfo is None:
                raise FlagError("expires_at", "must be timezone-aware", value=expires_at)
            if expires_at <= now:
                raise FlagError("expires_at", "must lie in the future", value=expires_at)
        row = queries.flag_row(session, name, scope, source)
        old = row.value if row is not None else None
        if row is None:
            row = Flag(name=name, scope=scope, source=source, created_at=now)
            session.add(row)
        row.value = value
        row.reason = reason
        row.actor = actor
        row.expires_at = expires_at
        row.alert_id = alert_id
        row.updated_at = now
        self._audit(session, now, name, scope, actor, source, "set", old, value, reason,
                    alert_id)
        session.flush()
        return _view(row)

    def clear(self, session: Session, name: str, scope: str, *, reason: str, actor: str,
              source: str = "manual", action: str = "clear") -> bool:
        """Remove a flag row (the default or the other source's value applies again)."""
        validate(name, scope, check_value=False)
        _check_source(source)
        _check_text("reason", reason)
        _check_text("actor", actor)
        row = queries.flag_row(session, name, scope, source)
        if row is None:
            return False
        # Undoing an automatic change answers the same alert that made it.
        self._audit(session, self.clock(), name, scope, actor, source, action, row.value,
                    None, reason, row.alert_id)
        session.delete(row)
        session.flush()
        return True

    def list(self, session: Session, *, include_expired: bool = False) -> list[FlagView]:
        """Return stored flag rows of both sources."""
        now = self.clock()
        return [_view(f) for f in queries.flag_rows(session)
                if include_expired or f.expires_at is None or f.expires_at > now]

    def effective(self, session: Session) -> dict[tuple[str, str], FlagView]:
        """Return (name, scope) -> the row in force: manual over auto, expired ignored."""
        out: dict[tuple[str, str], FlagView] = {}
        for f in self.list(session):
            key = (f.name, f.scope)
            if key not in out or f.source == "manual":
                out[key] = f
        return out

    def runtime_flags(self, session: Session, instance_id: str | None = None) -> RuntimeFlags:
        """Return the RuntimeFlags the engine of `instance_id` should use now."""
        eff = self.effective(session)
        spec = {s: bool(f.value) for (n, s), f in eff.items()
                if n == "speculative" and s != FLAG_SCOPE_GLOBAL}
        # Manual wins everywhere: where a person turned speculation off, no probation.
        manual_off = frozenset(f.scope for f in eff.values()
                               if f.name == "speculative" and f.source == "manual"
                               and f.value is False)

        def value(name: str, default: Any, scope: str = FLAG_SCOPE_GLOBAL) -> Any:
            f = eff.get((name, scope))
            return default if f is None else f.value

        compiled = bool(value("compiled", True))
        native_step = bool(value("native_step", True))
        batching = bool(value("batching", True))
        if instance_id is not None:
            compiled = bool(value("compiled", compiled, instance_scope(instance_id)))
            native_step = bool(value("native_step", native_step, instance_scope(instance_id)))
            batching = bool(value("batching", batching, instance_scope(instance_id)))
        return RuntimeFlags(
            speculative_default=bool(value("speculative", True)),
            speculative=spec,
            speculative_probation=float(value("speculative_probation", 0.0)),
            compiled=compiled,
            bucketing=bool(value("bucketing", True)),
            manual_off=manual_off,
            quantized_default=bool(value("quantized", True)),
            quantized={s: bool(f.value) for (n, s), f in eff.items()
                       if n == "quantized" and s != FLAG_SCOPE_GLOBAL},
            native_step=native_step,
            batching=batching,
        )

    def expire(self, session: Session) -> int:
        """Delete expired rows, auditing each; return how many."""
        now = self.clock()
        rows = queries.expired_flags(session, now)
        for f in rows:
            tag = f" [alert {f.alert_id}]" if f.alert_id is not None else ""
            self._audit(session, now, f.name, f.scope, "expiry", f.source, "expire", f.value,
                        None, f"expired at {f.expires_at.isoformat() if f.expires_at else ''}{tag}",
                        f.alert_id)
            session.delete(f)
        session.flush()
        return len(rows)

    def audit(self, session: Session, name: str | None = None, scope: str | None = None, *,
              since: datetime | None = None, limit: int = 100) -> builtins.list[AuditView]:
        """Return audit rows, newest first."""
        if name is not None:
            validate(name, scope or FLAG_SCOPE_GLOBAL, check_value=False)
        return [AuditView(a.at, a.name, a.scope, a.actor, a.source, a.action, a.old_value,
                          a.new_value, a.reason, a.alert_id)
                for a in queries.flag_audits(session, name, scope, since=since, limit=limit)]


def _check_source(source: str) -> None:
    if source not in FLAG_SOURCES:
        raise FlagError("source", f"must be one of {', '.join(FLAG_SOURCES)}", value=source)


def _check_text(field: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise FlagError(field, "must not be empty", value=value)


class SqlFlagProvider:
    """engine.protocol.FlagProvider over the flag tables, cached for `ttl_s`.

    Raises on database errors; the engine then keeps the last flags it had.
    """

    def __init__(self, sessions: sessionmaker[Session], ttl_s: float = 1.0, *,
                 store: FlagStore | None = None, instance_id: str | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self.instance_id = instance_id  # an "instance:<id>" scope applies to this engine
        self.store = store or FlagStore()
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._flags: RuntimeFlags | None = None
        self._loaded_at = float("-inf")

    def flags(self) -> RuntimeFlags:
        """Return the effective flags, read from SQL at most once per ttl."""
        with self._lock:
            if self._flags is not None and self.monotonic() - self._loaded_at < self.ttl_s:
                return self._flags
            # Read-only: on SQLite no BEGIN IMMEDIATE, so a writer's transaction (an
            # evaluation's, the probe writer's) does not make this read wait.
            with reading(self.sessions) as session:
                flags = self.store.runtime_flags(session, self.instance_id)
            self._flags = flags
            self._loaded_at = self.monotonic()
            return flags

    def invalidate(self) -> None:
        """Forget the cached flags (the API calls this after a change in-process)."""
        with self._lock:
            self._loaded_at = float("-inf")


class FlagsUnavailable(AlertsError):
    """No flag snapshot yet: the first read of the flag tables has not succeeded."""


class FlagSnapshot:
    """engine.protocol.FlagProvider that never touches SQL on the caller's thread.

    `flags()` returns the last snapshot read; a background thread re-reads the flag
    tables every `ttl_s` and at once after `invalidate()`. A failed refresh (database
    locked or down) keeps the last snapshot, is counted in `refresh_failures` and logged
    once per outage. Before the first successful read `flags()` raises FlagsUnavailable
    at once (the engine's guard then keeps its last known flags).

    Example:
        snapshot = FlagSnapshot(sessions, ttl_s=1.0, instance_id="replica-a")
        snapshot.start()                 # first read, then the refresh thread
        engine.load_engine(cfg, flags=snapshot)
        snapshot.close()
    """

    in_memory = True  # engine.protocol.FlagProvider: read on the request's thread

    def __init__(self, sessions: sessionmaker[Session], ttl_s: float = 1.0, *,
                 store: FlagStore | None = None, instance_id: str | None = None) -> None:
        self.source = SqlFlagProvider(sessions, ttl_s=0.0, store=store, instance_id=instance_id)
        # ttl 0 would spin the thread; a change still applies at once through invalidate().
        self.ttl_s = max(ttl_s, 0.05)
        self._flags: RuntimeFlags | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._refreshed = threading.Condition()
        self._generation = 0  # refresh attempts finished
        self._busy = False  # a refresh is reading now
        self._thread: threading.Thread | None = None
        self._failing = False
        self.refresh_failures = 0
        self.last_error: str | None = None

    def start(self) -> None:
        """Read once now (a failure is counted, not raised), then refresh in the background."""
        self._refresh()
        self._thread = threading.Thread(target=self._loop, name="tailwatch-flag-snapshot",
                                        daemon=True)
        self._thread.start()

    def flags(self) -> RuntimeFlags:
        """Return the snapshot; raise FlagsUnavailable when no read has succeeded yet."""
        flags = self._flags
        if flags is None:
            raise FlagsUnavailable(self.last_error or "flags not read yet")
        return flags

    def invalidate(self) -> None:
        """Ask the refresh thread for a new snapshot now (returns at once)."""
        self._wake.set()

    @property
    def generation(self) -> int:
        """Return how many refreshes (successful or not) have finished."""
        with self._refreshed:
            return self._generation

    def refresh_now(self, timeout_s: float) -> bool:
        """Refresh in the background and wait for it (a flag write path, never a request).

        Returns whether a refresh that began after this call finished within `timeout_s`.
        """
        with self._refreshed:
            # A refresh in flight may have read before the caller's change: wait for the next.
            target = self._generation + (2 if self._busy else 1)
        self._wake.set()
        return self.wait_generation(target, timeout_s)

    def wait_generation(self, generation: int, timeout_s: float) -> bool:
        """Wait until `generation` refreshes have finished; return whether they did in time."""
        with self._refreshed:
            return self._refreshed.wait_for(lambda: self._generation >= generation, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the refresh thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.ttl_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self._refresh()

    def _refresh(self) -> None:
        with self._refreshed:
            self._busy = True
        try:
            flags = self.source.flags()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the last snapshot
            self._failed(exc)
        else:
            self._flags = flags
            if self._failing:
                log.info("flags: snapshot refreshed again after %d failed read(s)",
                         self.refresh_failures)
            self._failing = False
        with self._refreshed:
            self._busy = False
            self._generation += 1
            self._refreshed.notify_all()

    def _failed(self, exc: Exception) -> None:
        first = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        self.last_error = f"{type(exc).__name__}: {first[0] if first else ''}"
        self.refresh_failures += 1
        if not self._failing:
            log.warning("flags: cannot refresh the flag snapshot (%s); serving the last one "
                        "until the database answers", self.last_error)
        self._failing = True
