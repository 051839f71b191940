"""The `alerts` section of the settings: rule, policy and webhook sources, timings."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator


class IncidentSettings(BaseModel):
    """How alerts group into incidents and how often an incident notifies (alerts.incidents)."""

    window_s: float = Field(150.0, ge=0)  # alerts firing this close together group
    hold_s: float = Field(600.0, ge=0)  # a member firing again this soon reopens it
    group_interval_s: float = Field(300.0, gt=0)  # at most one update/severity change per interval
    # Formats that get updates while members join or leave (generic/slack: off).
    update_formats: list[str] = Field(default_factory=lambda: ["alertmanager",
                                                               "alertmanager_api"])
    # A new incident with no A/B pair measured during it yet holds its first page this
    # long for the probable cause (two evaluation cycles; 0: off, it pages at once).
    cause_wait_s: float = 120.0

    @field_validator("cause_wait_s")
    @classmethod
    def _cause_wait(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"alerts.incidents.cause_wait_s must be >= 0 (0: off), got {v:g}")
        return v

    @field_validator("update_formats")
    @classmethod
    def _formats(cls, v: list[str]) -> list[str]:
        from alerts.webhooks import FORMATS

        bad = [f for f in v if f not in FORMATS]
        if bad:
            raise ValueError(f"must be among {', '.join(FORMATS)}, got {bad[0]!r}")
        return v


class AlertSettings(BaseModel):
    """Alert rules, webhooks and the auto-fallback policy; `alerts.config.load_config` reads it."""

    rules_file: str | None = None  # user YAML added to the shipped rules
    policy_file: str | None = None
    webhooks: list[dict[str, Any]] = Field(default_factory=list)
    external_url: str = ""  # this service's URL, for links in notifications
    baseline_refresh_s: float = Field(3600.0, gt=0)
    baseline_warm_in_s: float = Field(1800.0, ge=0)  # after a model/config change
    resend_interval_s: float = Field(120.0, gt=0)  # alertmanager_api re-sends firing alerts
    flags_ttl_s: float = Field(1.0, ge=0)  # SqlFlagProvider cache
    webhook_max_age_s: float = Field(86400.0, gt=0)  # undelivered this long: a dead letter
    # An instance silent this long is stale: its open alerts resolve (reason "stale").
    stale_after_s: float = Field(900.0, gt=0)
    incidents: IncidentSettings = Field(default_factory=IncidentSettings)
    # Per series: where a rule's threshold would page more often on its measured noise,
    # the smallest threshold within this is used (alerts.sensitivity); null: off.
    false_page_budget_per_30d: float | None = Field(0.5, ge=0)
    sensitivity_within_cycles: int = Field(10, ge=1)  # N: the detectable shift's deadline
    # Recent history each estimate resamples (raw cycles: a pooled quantile needs its
    # cycles' own samples), and the CPU one series' estimate may take. A rule of longer
    # cycles (or a season's) reads back as far as its needed cycles take, at most
    # sensitivity_max_history_s: keep that within retention.raw_days, past which the raw
    # cycles are pruned (alerts.sensitivity.reach_s).
    sensitivity_history_s: float = Field(86400.0, gt=0)
    sensitivity_max_history_s: float = Field(14 * 86400.0, gt=0)
    sensitivity_cpu_s: float = Field(2.0, gt=0)
    # A series states its false pages only from this much history (and 360 cycles); until
    # then, with the budget on, its pages are held as warnings: a month's false pages are
    # not read off an hour of a host (one cron run, one neighbour's job).
    sensitivity_min_history_s: float = Field(21600.0, ge=0)
    # ... and from this many usable cycles (the rules' one-minute cycles: 360 is 6 h).
    sensitivity_min_history_cycles: int = Field(360, ge=10)
    # The scheduled refresh: how often, and the CPU one run may spend (the rest waits).
    sensitivity_interval_s: float = Field(300.0, gt=0)
    sensitivity_job_cpu_s: float = Field(20.0, gt=0)

    @field_validator("webhooks")
    @classmethod
    def _webhooks(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from alerts.webhooks import parse_targets

        parse_targets(v)  # raises naming the target and field
        return v

    @model_validator(mode="after")
    def _min_history(self) -> AlertSettings:
        # An estimate reads sensitivity_history_s of cycles: asking for more would hold a
        # series' pages for ever.
        if self.sensitivity_min_history_s > self.sensitivity_history_s:
            raise ValueError(
                f"sensitivity_min_history_s: {self.sensitivity_min_history_s:g} s exceeds "
                f"sensitivity_history_s ({self.sensitivity_history_s:g} s), the history an "
                "estimate reads")
        if self.sensitivity_history_s > self.sensitivity_max_history_s:
            raise ValueError(
                f"sensitivity_history_s: {self.sensitivity_history_s:g} s exceeds "
                f"sensitivity_max_history_s ({self.sensitivity_max_history_s:g} s), the "
                "furthest back an estimate reads")
        return self
