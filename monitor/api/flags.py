"""The flag API: list, set and clear runtime flags; every change audited with its actor."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from alerts.flags import AuditView, FlagStore, FlagView, applies_to
from monitor.api.deps import (
    EngineHolderDep,
    FlagProviderDep,
    ReaderDep,
    SessionsDep,
    SettingsDep,
    WriterDep,
)
from monitor.api.errors import NotFound
from monitor.api.fields import Name64, Reason, UtcTime
from monitor.events import log_flag_change
from storage.db import reading
from storage.models import FLAG_SCOPE_GLOBAL

router = APIRouter(tags=["flags"])
# Seconds a flag write waits for the engine's flag snapshot to re-read (a database slower
# than that applies the change at the next background refresh instead).
REFRESH_WAIT_S = 5.0
_store = FlagStore()
FlagName = Name64  # flags.name; alerts.flags refuses unknown names (422)
FlagScope = Name64  # flags.scope; alerts.flags refuses scopes a flag lacks (422)


@dataclass(frozen=True)
class FlagOut(FlagView):
    """One stored flag row; `in_force` marks the row this instance's engine uses (manual
    wins; another instance's "instance:<id>" rows are never in force here)."""

    in_force: bool = True


class FlagsOut(BaseModel):
    """Stored rows (every instance's) and the flags this instance's engine reads now
    (defaults filled in, its own "instance:<id>" scope applied; `effective.instance_id`)."""

    flags: list[FlagOut]
    effective: dict[str, Any]


def _flag_value(value: Any) -> Any:
    # One field, not a union: an error names "value", not "value.bool".
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1:
        return value
    raise ValueError("must be true, false or a finite share in [0, 1]")


FlagValue = Annotated[Any, AfterValidator(_flag_value), WithJsonSchema(
    {"anyOf": [{"type": "boolean"}, {"type": "number", "minimum": 0, "maximum": 1}]})]


class FlagChange(BaseModel):
    """Set a manual flag value."""

    model_config = ConfigDict(extra="forbid")

    scope: FlagScope = Field(FLAG_SCOPE_GLOBAL,
                             description='"global" or a bucket label such as "64"')
    value: FlagValue = Field(description="true/false, or a share in [0, 1] for "
                                         "speculative_probation")
    reason: Reason = Field(description="Why (kept in the audit log)")
    expires_at: UtcTime | None = Field(
        None, description="RFC 3339 with a UTC offset; the override lapses then")


@dataclass(frozen=True)
class AuditOut(AuditView):
    """One audit row."""

    # Not served: an automatic change's reason already names its alert ("[alert 7]").
    alert_id: Annotated[int | None, Field(exclude=True)] = None


class Cleared(BaseModel):
    """A removed manual override."""

    name: str
    scope: str
    cleared: bool
    actor: str


@router.get("/v1/flags")
def list_flags(sessions: SessionsDep, holder: EngineHolderDep, settings: SettingsDep,
               _actor: ReaderDep) -> FlagsOut:
    """Return every stored flag row and this instance's effective runtime flags."""
    here = settings.instance_id
    with reading(sessions) as session:
        rows = _store.list(session)
        in_force = {(f.name, f.scope, f.source) for f in _store.effective(session).values()
                    if applies_to(f.scope, here)}
        # The engine's own provider reads with its instance id (alerts.flags.SqlFlagProvider).
        effective = _store.runtime_flags(session, here)
    out = [FlagOut(**asdict(r), in_force=(r.name, r.scope, r.source) in in_force) for r in rows]
    eff = asdict(effective)
    eff["instance_id"] = here
    eff["speculative"] = dict(effective.speculative)
    eff["manual_off"] = sorted(effective.manual_off)
    # Whether a draft is loaded at all (a user model without draft_dir decodes directly).
    engine = holder.get()
    if engine is not None:
        eff["speculative_available"] = engine.info.speculative_available
        eff["speculative_reason"] = engine.info.speculative_reason
        # live: read from the database; file: the last known flags (database unreachable).
        eff["source"] = engine.flag_source()
    return FlagsOut(flags=out, effective=eff)


@router.get("/v1/flags/audit")
def flag_audit(
    sessions: SessionsDep,
    _actor: ReaderDep,
    name: Annotated[FlagName | None, Query()] = None,
    scope: Annotated[FlagScope | None, Query()] = None,
    since: Annotated[UtcTime | None, Query(description="RFC 3339 with a UTC offset")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[AuditOut]:
    """Return flag changes, newest first."""
    with reading(sessions) as session:
        rows = _store.audit(session, name, scope, since=since, limit=limit)
    return [AuditOut(**asdict(a)) for a in rows]


@router.put("/v1/flags/{name}")
def set_flag(name: Annotated[FlagName, Path()], body: FlagChange, sessions: SessionsDep, provider: FlagProviderDep,
             actor: WriterDep) -> FlagOut:
    """Set a manual flag (it wins over automatic fallbacks) and audit the change."""
    with sessions.begin() as session:
        view = _store.set(session, name, body.scope, body.value, reason=body.reason,
                          actor=actor, source="manual", expires_at=body.expires_at)
    _invalidate(provider)
    log_flag_change("set", name, body.scope, actor, body.reason, view.value)
    return FlagOut(**asdict(view))


@router.delete("/v1/flags/{name}")
def clear_flag(
    name: Annotated[FlagName, Path()],
    sessions: SessionsDep,
    provider: FlagProviderDep,
    actor: WriterDep,
    reason: Annotated[Reason, Query(description="Why (kept in the audit log)")],
    scope: Annotated[FlagScope, Query()] = FLAG_SCOPE_GLOBAL,
) -> Cleared:
    """Remove a manual override (an automatic value or the default applies again)."""
    with sessions.begin() as session:
        cleared = _store.clear(session, name, scope, reason=reason, actor=actor)
    if not cleared:
        raise NotFound("name", f"no manual override of {name} in scope {scope!r}")
    _invalidate(provider)
    log_flag_change("cleared", name, scope, actor, reason)
    return Cleared(name=name, scope=scope, cleared=True, actor=actor)


def _invalidate(provider: Any) -> None:
    # A change made here applies to the next request: the snapshot (alerts.flags.FlagSnapshot)
    # re-reads before the answer; the operator's write waits on SQL, requests never do.
    refresh_now = getattr(provider, "refresh_now", None)
    if refresh_now is not None:
        refresh_now(REFRESH_WAIT_S)
        return
    invalidate = getattr(provider, "invalidate", None)
    if invalidate is not None:
        invalidate()
