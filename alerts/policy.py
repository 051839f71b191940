"""Auto-fallback: firing alerts flip flags, measured recovery flips them back.

Each evaluation (`Policy.apply`, called by `alerts.evaluator.evaluate`):
1. expire flags past their expires_at (audited);
2. for every firing alert named in a policy's `alerts`, set the policy's flag automatically in
   the scope the alert's label names, with the alert id and reason, unless a manual flag
   holds that flag and scope, or this scope was restored/reverted within `cooldown`;
3. revert an automatic change when a `revert.alerts` alert started firing within
   `revert.within` after it (the change made p99 worse);
4. restore an automatic flag once it has been held for `hold` and its recovery measure
   says so: `probation_acceptance` reads the bucket's probation requests (real traffic
   that keeps speculating while the flag is off), `canary_variant` reads the canaries' A/B
   arm that still runs the disabled path, paired per prompt with the fallback path served
   now (the measured speedup, storage.queries.speedups), `traffic_recompiles` reads real
   traffic's recompiles (never the canaries': their fixed shapes do not churn) in the
   flag's scope;
5. re-engage a restored fallback while the alert that caused it is still firing and its
   latest cycle still breaches (a restore is a trial; the cooldown does not hold it back);
6. keep `speculative_probation` at the largest probation share while any bucket is
   automatically off and no manual flag turned speculation off there (manual wins).

Scopes: `scope_from: bucket` (speculative) turns one bucket off; `scope_from: instance`
(compiled) makes the eager fallback of only the instance whose alert fired
("instance:<id>"); a policy without scope_from acts on its `scope` (global: the fleet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from sqlalchemy.orm import Session

from alerts.durations import parse_duration
from alerts.errors import FlagError, PolicyError
from alerts.flags import (
    FLAG_NAMES,
    INSTANCE_SCOPE_PREFIX,
    FlagStore,
    FlagView,
    instance_scope,
)
from alerts.flags import validate as validate_flag
from alerts.quality import canary_recovery
from alerts.rule_file import parse_change
from alerts.schema import Entry, read_layered, validate
from storage.models import FLAG_SCOPE_GLOBAL, Alert
from storage.queries import acceptance
from storage.queries import alerts as alert_queries
from storage.queries.baselines import baseline_in_force
from storage.queries.compiles import traffic_compiles
from storage.queries.runs import current_cohort
from storage.queries.speedups import (
    ALL_BUCKETS,
    OPTIMIZATION_OF_ARM,
    REVERSE_ARMS,
    ArmSpeedup,
    ab_speedups,
    instance_speedups,
)
from vocab import Variant

DEFAULT_POLICY_FILE = Path(__file__).with_name("policy.yaml")
MEASURES = ("probation_acceptance", "canary_variant", "traffic_recompiles", "canary_agreement",
            "native_step_arm", "hold", "expiry")
# flag -> alert label
SCOPE_FROM = {"speculative": "bucket", "compiled": "instance", "quantized": "bucket",
              "native_step": "instance", "batching": "instance"}
NATIVE_STEP = Variant.NATIVE_STEP.value
STEP = OPTIMIZATION_OF_ARM[NATIVE_STEP]  # the optimization the C step's arms measure


@dataclass(frozen=True)
class SlowerTrigger:
    """Set the flag where the C decode step measured slower than the compiled step.

    Per instance, over the `compiled_step` arm's pairs of the last `window_s`
    (storage.queries.speedups): fires when the C step's speedup is below 1 / (1 + margin)
    on at least `min_pairs`.
    """

    margin: float = 0.05
    window_s: float = 1800.0
    min_pairs: int = 12

    @property
    def below(self) -> float:
        """Return the speedup under which the trigger fires."""
        return 1.0 / (1.0 + self.margin)


@dataclass(frozen=True)
class Recovery:
    """How recovery is measured before an automatic flag is restored."""

    measure: str = "expiry"
    window_s: float = 600.0
    min_samples: int = 1
    within: float = 0.0  # allowed relative shortfall (acceptance) or excess (latency)
    floor: float | None = None
    variant: str = "compiled"
    limit: float = 0.0  # traffic_recompiles: restore while below this many per hour


@dataclass(frozen=True)
class FallbackPolicy:
    """One mapping from alerts to a flag change."""

    name: str
    on: tuple[str, ...]
    flag: str
    value: Any
    scope_from: str | None = None
    scope: str = FLAG_SCOPE_GLOBAL
    probation: float = 0.0
    expires_s: float | None = None
    hold_s: float = 600.0
    cooldown_s: float = 1800.0
    recovery: Recovery = field(default_factory=Recovery)
    description: str = ""
    slower: SlowerTrigger | None = None


@dataclass(frozen=True)
class PolicyAction:
    """One thing the policy did (or chose not to do) this evaluation."""

    kind: str  # set | restore | revert | skip | probation | expire
    flag: str
    scope: str
    value: Any = None
    reason: str = ""
    alert_id: int | None = None


def _tag(alert_id: int | None) -> str:
    return f" [alert {alert_id}]" if alert_id is not None else ""


class Policy:
    """The auto-fallback policy over a FlagStore."""

    def __init__(self, policies: Sequence[FallbackPolicy], *, revert_on: Sequence[str] = (),
                 revert_within_s: float = 1800.0) -> None:
        self.policies = list(policies)
        self.revert_on = tuple(revert_on)
        self.revert_within_s = revert_within_s

    def _scope(self, p: FallbackPolicy, alert: Alert) -> str | None:
        if p.scope_from is None:
            return p.scope
        value = (alert.labels or {}).get(p.scope_from) or None
        if value is not None and p.scope_from == "instance":
            scope = instance_scope(value)
            try:
                validate_flag(p.flag, scope, check_value=False)
            except FlagError:
                return None  # an instance id no flag scope can hold (set instance_id shorter)
            return scope
        return value

    def apply(self, session: Session, now: datetime, *, actor: str = "policy") -> list[PolicyAction]:
        """Run one policy pass at `now`; return what it did."""
        store = FlagStore(clock=lambda: now)
        actions = [PolicyAction("expire", "*", "*", reason=f"{n} expired")
                   for n in [store.expire(session)] if n]
        firing = alert_queries.firing_alerts(session)
        flags = {(f.name, f.scope, f.source): f for f in store.list(session)}
        for p in self.policies:
            for alert in firing:
                if alert.rule not in p.on:
                    continue
                scope = self._scope(p, alert)
                if scope is None:
                    continue
                if (p.flag, scope, "manual") in flags:
                    actions.append(PolicyAction("skip", p.flag, scope, reason=(
                        f"manual flag holds {p.flag}/{scope}"), alert_id=alert.id))
                    continue
                if (p.flag, scope, "auto") in flags:
                    continue
                again = self._retry(store, session, p, scope, alert)
                recent = None if again else self._recent_undo(store, session, p, scope, now,
                                                               alert.id)
                if recent:
                    actions.append(PolicyAction("skip", p.flag, scope, reason=recent,
                                                alert_id=alert.id))
                    continue
                summary = (alert.annotations or {}).get("summary", "")
                reason = f"{p.name}: {alert.rule} firing ({summary}){_tag(alert.id)}"
                if again:
                    reason = f"re-engaged: {again}; {reason}"
                expires = now + timedelta(seconds=p.expires_s) if p.expires_s else None
                view = store.set(session, p.flag, scope, p.value, source="auto", reason=reason,
                                 actor=actor, expires_at=expires, alert_id=alert.id)
                flags[(p.flag, scope, "auto")] = view
                actions.append(PolicyAction("set", p.flag, scope, p.value, reason, alert.id))
        actions += self._slower(session, store, flags, now, actor)
        actions += self._reverts(session, store, flags, now, actor)
        actions += self._recoveries(session, store, flags, now, actor)
        actions += self._probation(session, store, flags, actor)
        return actions

    def _policy_for(self, f: FlagView) -> FallbackPolicy | None:
        for p in self.policies:
            if p.flag == f.name and p.value == f.value:
                return p
        return None

    def _retry(self, store: FlagStore, session: Session, p: FallbackPolicy, scope: str,
               alert: Alert) -> str | None:
        """Return why a restored fallback must come back (None: it need not)."""
        for a in store.audit(session, p.flag, scope, limit=20):
            if a.source != "auto" or a.action not in ("restore", "revert", "expire"):
                continue
            # Only a restore is a trial: a revert said the fallback itself hurt.
            if a.action == "restore" and alert.consecutive_breaches > 0:
                if a.alert_id == alert.id:
                    return f"alert {alert.id} still firing after the restore at {a.at.isoformat()}"
                return f"alert {alert.id} fired after the restore at {a.at.isoformat()}"
            return None
        return None

    def _recent_undo(self, store: FlagStore, session: Session, p: FallbackPolicy, scope: str,
                     now: datetime, alert_id: int) -> str | None:
        for a in store.audit(session, p.flag, scope, limit=20):
            if a.source != "auto" or a.action not in ("restore", "revert", "expire"):
                continue
            if a.alert_id == alert_id:
                return f"{a.action} done for alert {alert_id}; waits for a new alert"
            if now - a.at < timedelta(seconds=p.cooldown_s):
                return f"{a.action} at {a.at.isoformat()}, cooldown {p.cooldown_s:g}s"
        return None

    def _slower(self, session: Session, store: FlagStore, flags: dict, now: datetime,
                actor: str) -> list[PolicyAction]:
        """Set each `slower` policy's flag on the instances where the C step lost."""
        out = []
        for p in self.policies:
            s = p.slower
            if s is None:
                continue
            start = now - timedelta(seconds=s.window_s)
            for inst, m in instance_speedups(session, start, now, STEP,
                                             arms=(Variant.COMPILED_STEP.value,)).items():
                if m.pairs < s.min_pairs or m.speedup >= s.below:
                    continue
                scope = instance_scope(inst) if p.scope_from == "instance" else p.scope
                try:
                    validate_flag(p.flag, scope, check_value=False)
                except FlagError:
                    continue  # an instance id no flag scope can hold
                if (p.flag, scope, "auto") in flags:
                    continue
                if (p.flag, scope, "manual") in flags:
                    out.append(PolicyAction("skip", p.flag, scope, reason=(
                        f"manual flag holds {p.flag}/{scope}")))
                    continue
                since = self._last_undo(store, session, p, scope)
                if since is not None and since > start:
                    # Judge only what ran since the last restore (or wait for the cooldown).
                    if now - since < timedelta(seconds=p.cooldown_s):
                        continue
                    m = instance_speedups(session, since, now, STEP, instance_id=inst,
                                          arms=(Variant.COMPILED_STEP.value,)).get(inst, m)
                    if m.pairs < s.min_pairs or m.speedup >= s.below:
                        continue
                reason = (f"{p.name}: the C decode step measured {m.speedup:.3f}x the compiled "
                          f"step over {m.pairs} canary pairs{_ci(m)} on instance {inst} "
                          f"(fires below {s.below:.3f}x)")
                expires = now + timedelta(seconds=p.expires_s) if p.expires_s else None
                flags[(p.flag, scope, "auto")] = store.set(
                    session, p.flag, scope, p.value, source="auto", reason=reason, actor=actor,
                    expires_at=expires)
                out.append(PolicyAction("set", p.flag, scope, p.value, reason))
        return out

    @staticmethod
    def _last_undo(store: FlagStore, session: Session, p: FallbackPolicy,
                   scope: str) -> datetime | None:
        for a in store.audit(session, p.flag, scope, limit=20):
            if a.source == "auto" and a.action in ("restore", "revert", "expire"):
                return a.at
        return None

    def _reverts(self, session: Session, store: FlagStore, flags: dict, now: datetime,
                 actor: str) -> list[PolicyAction]:
        if not self.revert_on:
            return []
        out = []
        window = timedelta(seconds=self.revert_within_s)
        regressions = alert_queries.firing_alerts(session, self.revert_on)
        for key, f in list(flags.items()):
            if f.source != "auto" or f.name == "speculative_probation":
                continue
            if now - f.updated_at > window:
                continue
            for r in regressions:
                if r.fired_at is None or r.fired_at < f.updated_at or r.fired_at - f.updated_at > window:
                    continue
                labels = r.labels or {}
                if f.scope.startswith(INSTANCE_SCOPE_PREFIX):
                    if labels.get("instance") not in (None, f.scope[len(INSTANCE_SCOPE_PREFIX):]):
                        continue
                elif f.scope != FLAG_SCOPE_GLOBAL and labels.get("bucket") not in (None, f.scope):
                    continue
                reason = (f"reverted: {r.rule} started firing {r.fired_at - f.updated_at} after "
                          f"the automatic change ({f.reason}){_tag(f.alert_id)}")
                store.clear(session, f.name, f.scope, source="auto", reason=reason, actor=actor,
                            action="revert")
                del flags[key]
                out.append(PolicyAction("revert", f.name, f.scope, None, reason, f.alert_id))
                break
        return out

    def _recoveries(self, session: Session, store: FlagStore, flags: dict, now: datetime,
                    actor: str) -> list[PolicyAction]:
        out = []
        for key, f in list(flags.items()):
            if f.source != "auto" or f.name == "speculative_probation":
                continue
            p = self._policy_for(f)
            if p is None or now - f.updated_at < timedelta(seconds=p.hold_s):
                continue
            verdict = measure_recovery(session, p, f.scope, now)
            if verdict is None:
                continue
            reason = f"restored: {verdict}{_tag(f.alert_id)}"
            store.clear(session, f.name, f.scope, source="auto", reason=reason, actor=actor,
                        action="restore")
            del flags[key]
            out.append(PolicyAction("restore", f.name, f.scope, None, reason, f.alert_id))
        return out

    def _probation(self, session: Session, store: FlagStore, flags: dict,
                   actor: str) -> list[PolicyAction]:
        key = ("speculative_probation", FLAG_SCOPE_GLOBAL, "auto")
        want = 0.0
        # Manual wins: a bucket a person turned off (or a global manual off) gets no probation.
        manual_off = {f.scope for f in flags.values()
                      if f.source == "manual" and f.name == "speculative" and f.value is False}
        for f in flags.values():
            if f.source == "auto" and f.name == "speculative" and f.value is False:
                if manual_off & {f.scope, FLAG_SCOPE_GLOBAL}:
                    continue
                p = self._policy_for(f)
                want = max(want, p.probation if p is not None else 0.0)
        have = flags.get(key)
        if want > 0 and (have is None or have.value != want):
            reason = f"probation {want:g} while speculation is automatically off somewhere"
            flags[key] = store.set(session, *key[:2], want, source="auto", reason=reason,
                                   actor=actor)
            return [PolicyAction("probation", key[0], key[1], want, reason)]
        if want == 0 and have is not None:
            reason = "no bucket is automatically off (without a manual off) any more"
            store.clear(session, *key[:2], source="auto", reason=reason, actor=actor)
            del flags[key]
            return [PolicyAction("probation", key[0], key[1], 0.0, reason)]
        return []


def measure_recovery(session: Session, p: FallbackPolicy, scope: str, now: datetime) -> str | None:
    """Return why the disabled path has recovered, or None while it has not (or is unmeasured)."""
    r = p.recovery
    start = now - timedelta(seconds=r.window_s)
    if r.measure == "probation_acceptance":
        rows = [a for a in acceptance(session, start, now, source="probation")
                if scope in (FLAG_SCOPE_GLOBAL, a.bucket)]
        proposed = sum(a.draft_tokens for a in rows)
        if proposed < r.min_samples or proposed == 0:
            return None
        rate = sum(a.accepted_tokens for a in rows) / proposed
        base = _baseline(session, "acceptance_rate", {"source": "traffic", "bucket": scope}, now)
        if base is not None and base > 0:
            need = base * (1 - r.within)
            what = f"baseline {base:.3f} -{r.within:.0%}"
        elif r.floor is not None:
            need, what = r.floor, "floor"
        else:
            return None
        if rate >= need:
            return (f"probation acceptance {rate:.3f} >= {need:.3f} ({what}) over "
                    f"{proposed} draft tokens in {r.window_s:g}s")
        return None
    if r.measure == "canary_variant":
        return _arm_recovered(session, r, scope, start, now)
    if r.measure == "traffic_recompiles":
        # Judged over the hold (at least): the rate must have stayed low all that time.
        span = max(r.window_s, p.hold_s)
        instance = _instance_of(scope)
        seen = traffic_compiles(session, now - timedelta(seconds=span), now,
                                instance_id=instance)
        per_hour = (seen.recompiles + seen.failures) * 3600.0 / span
        if per_hour < r.limit or (r.limit == 0 and per_hour == 0):
            where = f"instance {instance}" if instance else "the fleet"
            return (f"real-traffic recompiles {per_hour:.3g}/h < {r.limit:g}/h on {where} "
                    f"over {span:g}s")
        return None
    if r.measure == "native_step_arm":
        return _native_step_recovered(session, p, scope, start, now)
    if r.measure == "canary_agreement":
        # The A/B arm that still runs the disabled optimization (int8 switched back on).
        return canary_recovery(session, scope, start, now, variant=r.variant, floor=r.floor,
                               min_samples=r.min_samples)
    if r.measure == "hold":
        # Nothing to measure while the fallback runs (unbatched has no batch size to
        # judge): restore after the hold; the alert still firing brings it back (_retry).
        return f"held {p.hold_s:g}s"
    return None  # "expiry": only expires_at restores it


def _native_step_recovered(session: Session, p: FallbackPolicy, scope: str, start: datetime,
                           now: datetime) -> str | None:
    """Return why the C step may serve `scope` again: its reverse `native_step` arm agrees
    with the reference and is no slower than the compiled step (by the trigger's margin)."""
    r = p.recovery
    agrees = canary_recovery(session, scope, start, now, variant=Variant.NATIVE_STEP.value,
                             floor=r.floor, min_samples=r.min_samples)
    if agrees is None:
        return None
    measured = instance_speedups(session, start, now, STEP, arms=(NATIVE_STEP,),
                                 instance_id=_instance_of(scope))
    below = p.slower.below if p.slower is not None else 1.0 / (1.0 + r.within)
    if not measured or any(m.speedup < below for m in measured.values()):
        return None
    worst = min(measured.values(), key=lambda m: m.speedup)
    return (f"{agrees}; C step {worst.speedup:.3f}x the compiled step over {worst.pairs} "
            f"pairs{_ci(worst)} (>= {below:.3f}x)")


def _arm_recovered(session: Session, r: Recovery, scope: str, start: datetime,
                   now: datetime) -> str | None:
    """Return why the optimization `r.variant` switches back on may serve `scope` again.

    Its reverse A/B arm runs beside the fallback path the canaries serve now, prompt by
    prompt: the paired speedup (fallback / arm latency) must reach 1 / (1 + within) over
    at least `min_samples` pairs, in the flag's bucket (or over all buckets of the fleet
    or of the flag's instance).
    """
    instance = _instance_of(scope)
    bucket = ALL_BUCKETS if instance is not None or scope == FLAG_SCOPE_GLOBAL else scope
    rows = ab_speedups(session, start, now, arms=(r.variant,), instance_id=instance)
    m = next((x for x in rows if x.bucket == bucket), None)
    need = 1.0 / (1.0 + r.within)
    if m is None or m.pairs < r.min_samples or m.speedup < need:
        return None
    where = f"instance {instance}" if instance else (
        "every bucket" if bucket == ALL_BUCKETS else f"bucket {bucket}")
    return (f"canary {r.variant} arm {m.speedup:.3f}x the fallback path, paired per prompt "
            f"over {m.pairs} pairs{_ci(m)} in {where} (>= {need:.3f}x, within "
            f"+{r.within:.0%}) over {r.window_s:g}s")


def _instance_of(scope: str) -> str | None:
    """Return the instance an `instance:<id>` flag scope names, else None."""
    return scope[len(INSTANCE_SCOPE_PREFIX):] if scope.startswith(INSTANCE_SCOPE_PREFIX) else None


def _ci(m: ArmSpeedup) -> str:
    """Return the speedup's 95% confidence interval as text ("" under 6 pairs)."""
    if m.ci_low is None or m.ci_high is None:
        return ""
    return f" (95% CI {m.ci_low:.3f}-{m.ci_high:.3f}x)"


def _baseline(session: Session, metric: str, scope: Mapping[str, str],
              now: datetime) -> float | None:
    cohort = current_cohort(session, now).key
    base = baseline_in_force(session, metric, scope, cohort).baseline
    return base.value if base is not None else None


class RecoveryEntry(Entry):
    """A policy's `recovery` mapping as written in YAML."""

    measure: str = "expiry"
    window: float = 600.0
    min_samples: StrictInt = Field(1, ge=1)
    within: float = 0.0
    floor: StrictFloat | None = None
    variant: str = "compiled"
    limit: float = Field(0.0, ge=0.0)

    @field_validator("measure")
    @classmethod
    def _measure(cls, v: str) -> str:
        if v not in MEASURES:
            raise ValueError(f"must be one of {', '.join(MEASURES)}, got {v!r}")
        return v

    @field_validator("window", mode="before")
    @classmethod
    def _window(cls, v: object) -> float:
        return parse_duration(v)

    @field_validator("within", mode="before")
    @classmethod
    def _within(cls, v: object) -> float:
        return 0.0 if v in ("+0%", "-0%") else parse_change(v)[1]


class SlowerEntry(Entry):
    """A policy's `slower` mapping: set the flag where the C step measured slower."""

    margin: float = 0.05
    window: float = 1800.0
    min_pairs: StrictInt = Field(12, ge=1)

    @field_validator("margin", mode="before")
    @classmethod
    def _margin(cls, v: object) -> float:
        sign, size = parse_change(v)
        if sign != 1 or size <= 0:
            raise ValueError(f"must be a positive change such as '+5%', got {v!r}")
        return size

    @field_validator("window", mode="before")
    @classmethod
    def _window(cls, v: object) -> float:
        return parse_duration(v)


class PolicyEntry(Entry):
    """One auto-fallback policy as written in YAML; `parse_policy` validates it."""

    name: str
    description: str = ""
    alerts: tuple[str, ...]
    flag: str
    scope_from: str | None = None
    scope: str = FLAG_SCOPE_GLOBAL
    value: StrictBool = False
    probation: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    expires: float | None = None
    hold: float | None = 600.0
    cooldown: float | None = 1800.0
    recovery: RecoveryEntry = Field(default_factory=RecoveryEntry)
    slower: SlowerEntry | None = None

    @field_validator("alerts", mode="before")
    @classmethod
    def _alerts(cls, v: object) -> object:
        on = [v] if isinstance(v, str) else v
        if not isinstance(on, list) or not on or not all(isinstance(x, str) for x in on):
            raise ValueError("must be a non-empty list of rule names")
        return tuple(on)

    @field_validator("flag")
    @classmethod
    def _flag(cls, v: str) -> str:
        if v not in FLAG_NAMES or v == "speculative_probation":
            raise ValueError("must be speculative, compiled, bucketing, quantized or "
                             f"native_step, got {v!r}")
        return v

    @field_validator("scope_from")
    @classmethod
    def _scope_from(cls, v: str | None, info: ValidationInfo) -> str | None:
        flag = info.data.get("flag")
        if v is not None and SCOPE_FROM.get(str(flag)) != v:
            raise ValueError("speculative and quantized take their scope from the alert's "
                             "bucket label, compiled and native_step from its instance label; "
                             f"got {v!r} for {flag}")
        return v

    @field_validator("scope")
    @classmethod
    def _scope(cls, v: str, info: ValidationInfo) -> str:
        flag = info.data.get("flag")
        if v != FLAG_SCOPE_GLOBAL and flag not in ("speculative", "quantized"):
            raise ValueError(f"{flag} takes scope 'global' (the fleet) or scope_from: instance")
        return v

    @field_validator("expires", "hold", "cooldown", mode="before")
    @classmethod
    def _duration(cls, v: object) -> float | None:
        return None if v is None else parse_duration(v)

    @field_validator("recovery", mode="before")
    @classmethod
    def _recovery(cls, v: object) -> object:
        return v or {}

    def to_policy(self) -> FallbackPolicy:
        """Return the FallbackPolicy this entry describes."""
        r = self.recovery
        return FallbackPolicy(
            name=self.name, on=self.alerts, flag=self.flag, value=self.value,
            scope_from=self.scope_from, scope=self.scope, probation=float(self.probation),
            expires_s=self.expires, hold_s=self.hold or 0.0, cooldown_s=self.cooldown or 0.0,
            recovery=Recovery(measure=r.measure, window_s=r.window, min_samples=r.min_samples,
                              within=r.within, floor=r.floor, variant=r.variant,
                              limit=r.limit),
            description=self.description,
            slower=None if self.slower is None else SlowerTrigger(
                margin=self.slower.margin, window_s=self.slower.window,
                min_pairs=self.slower.min_pairs))


class RevertEntry(Entry):
    """The policy document's `revert` mapping: which alerts revert a fallback, how soon."""

    alerts: tuple[StrictStr, ...] | None = None
    within: float | None = None

    @field_validator("within", mode="before")
    @classmethod
    def _within(cls, v: object) -> float | None:
        return None if v is None else parse_duration(v)


def parse_policy(data: object, source: str = "<policy>") -> tuple[list[FallbackPolicy], dict]:
    """Validate a policy document; return (policies, revert settings)."""
    if data is None:
        return [], {}
    if not isinstance(data, dict) or set(data) - {"policies", "revert"}:
        raise PolicyError(source, "", "policies", "the document must map 'policies' and 'revert'")
    items = data.get("policies")
    items = [] if items is None else items
    if not isinstance(items, list):
        raise PolicyError(source, "", "policies", "must be a list")
    out = [_parse_one(item, source, i) for i, item in enumerate(items)]
    raw_revert = data.get("revert") or {}
    if not isinstance(raw_revert, dict):
        raise PolicyError(source, "revert", "revert", "must map 'alerts' and 'within'")
    revert = validate(RevertEntry, raw_revert, PolicyError, source, "revert")
    parsed: dict[str, Any] = {}
    if revert.alerts is not None:
        parsed["on"] = revert.alerts
    if revert.within is not None:
        parsed["within_s"] = revert.within
    return out, parsed


def _parse_one(raw: object, source: str, index: int) -> FallbackPolicy:
    entry = f"policy #{index + 1}"
    if not isinstance(raw, dict):
        raise PolicyError(source, entry, "policy", "must be a mapping")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise PolicyError(source, entry, "name", f"must be a non-empty string, got {name!r}")
    entry = f"policy {name!r}"
    policy = validate(PolicyEntry, raw, PolicyError, source, entry)
    if policy.recovery.measure == "probation_acceptance" and policy.flag != "speculative":
        raise PolicyError(source, entry, "recovery.measure",
                          "probation_acceptance only measures speculative flags")
    if policy.recovery.measure == "traffic_recompiles" and policy.flag != "compiled":
        raise PolicyError(source, entry, "recovery.measure",
                          "traffic_recompiles only measures the compiled flag")
    if policy.recovery.measure == "canary_variant" and (
            policy.recovery.variant != policy.flag or policy.flag not in REVERSE_ARMS):
        # The arm is paired with the fallback path: only the arm that switches this
        # policy's optimization back on measures whether it recovered.
        raise PolicyError(source, entry, "recovery.variant",
                          f"canary_variant reads the A/B arm that switches {policy.flag} back "
                          f"on: variant must be {policy.flag!r}"
                          if policy.flag in REVERSE_ARMS else
                          f"canary_variant has no A/B arm to read for {policy.flag}, got "
                          f"{policy.recovery.variant!r}")
    if policy.flag != "native_step":
        if policy.slower is not None:
            raise PolicyError(source, entry, "slower",
                              "slower only measures the native_step flag")
        if policy.recovery.measure == "native_step_arm":
            raise PolicyError(source, entry, "recovery.measure",
                              "native_step_arm only measures the native_step flag")
    return policy.to_policy()


def load_policy(policy_file: str | None = None, *, defaults: bool = True) -> Policy:
    """Return the shipped policy merged with the user's (entries replaced by name)."""
    merged: dict[str, FallbackPolicy] = {}
    revert: dict[str, Any] = {}
    for source, data in read_layered(DEFAULT_POLICY_FILE, policy_file, defaults=defaults,
                                     error=PolicyError, file_field="policy_file",
                                     doc_field="policies"):
        items, rv = parse_policy(data, source)
        for p in items:
            merged[p.name] = p
        revert.update(rv)
    return Policy(list(merged.values()), revert_on=revert.get("on", ()),
                  revert_within_s=revert.get("within_s", 1800.0))
