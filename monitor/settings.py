"""Typed settings from TAILWATCH_* environment variables and an optional YAML file.

Built by `get_settings()`, never at import. Nested fields use `__` in environment
variables: TAILWATCH_ENGINE__COMPILE_MODE=off. Each package owns one section.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

DEFAULT_DB_URL = "sqlite:///./var/tailwatch.db"


class EngineSettings(BaseModel):
    """Mirror of engine.EngineConfig (see that class for meanings)."""

    model_dir: str | None = None
    draft_dir: str | None = None
    use_draft: bool = True
    device: str = "auto"
    dtype: str = "auto"
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_input_tokens: int = 1024
    max_new_tokens: int = 32
    max_new_tokens_cap: int = 256
    compile_mode: str = "default"
    compile_backend: str = "inductor"
    num_threads: int = 1
    speculative_k: int = 4
    max_concurrency: int = 1
    max_queue: int = 16
    cache_dir: str | None = None

    def to_config(self) -> Any:
        """Return the engine.EngineConfig these settings describe."""
        from engine.config import EngineConfig

        return EngineConfig(**self.model_dump())


class ProbeSettings(BaseModel):
    """Canary and burst probes (probes package)."""

    suites_file: str | None = None  # user YAML added to the shipped suites
    suite: str = "in_domain"
    canaries_per_bucket: int = 4
    ab_share: float = Field(0.25, ge=0.0, le=1.0)
    cycle_timeout_s: float = 120.0
    burst_rate_per_s: float = 4.0
    burst_duration_s: float = 10.0
    burst_concurrency: int = 4
    rollup_buffer_max: int = 10_000
    # A/B fallback arms run. "exact" (bucketing's arm) compiles one graph per canary length
    # the first time: minutes on a CPU, during which A/B cycles time out; opt in to it.
    ab_arms: tuple[str, ...] = ("eager", "direct")


class SchedulerSettings(BaseModel):
    """APScheduler jobs; intervals in seconds, cron in crontab syntax."""

    enabled: bool = True
    probes_enabled: bool = True
    probe_interval_s: float = 60.0
    burst_interval_s: float = 900.0
    evaluate_interval_s: float = 60.0
    retention_cron: str = "17 3 * * *"
    report_cron: str = "0 6 * * mon"
    delivery_interval_s: float = 5.0
    traffic_flush_interval_s: float = 15.0
    misfire_grace_s: int = 30


class RetentionSettings(BaseModel):
    """How long data is kept."""

    raw_days: int = 14
    rollup_days: int = 90


class AlertSettings(BaseModel):
    """Alert rules, webhooks and the auto-fallback policy (alerts package)."""

    rules_file: str | None = None  # user YAML added to the shipped rules
    policy_file: str | None = None
    webhooks: list[dict[str, Any]] = Field(default_factory=list)
    external_url: str = ""  # this service's URL, for links in notifications
    baseline_refresh_s: float = Field(3600.0, gt=0)
    baseline_warm_in_s: float = Field(1800.0, ge=0)  # after a model/config change
    resend_interval_s: float = Field(120.0, gt=0)  # alertmanager_api re-sends firing alerts
    flags_ttl_s: float = Field(1.0, ge=0)  # SqlFlagProvider cache

    @field_validator("webhooks")
    @classmethod
    def _webhooks(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from alerts.webhooks import parse_targets

        parse_targets(v)  # raises naming the target and field
        return v


class ApiToken(BaseModel):
    """A named bearer token; the name is the actor in the audit log."""

    name: str
    token: SecretStr


class ApiSettings(BaseModel):
    """HTTP API and its auth."""

    host: str = "127.0.0.1"
    port: int = 8000
    auth: bool = True
    read_auth: bool = False
    tokens: list[ApiToken] = Field(default_factory=list)


class ReportSettings(BaseModel):
    """Weekly assumption-review report."""

    out_dir: str = "./var/reports"
    assumptions_file: str | None = None  # user YAML added to the shipped registry
    kv_cache_budget_bytes: int | None = Field(None, gt=0)  # KV cache's memory budget
    warmup_s: float = Field(1800.0, ge=0)  # compiles this long after an instance's first are warm-up
    notify: bool = True  # queue a short summary to the webhook targets


class Settings(BaseSettings):
    """Everything tailwatch reads at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="TAILWATCH_", env_nested_delimiter="__", extra="forbid"
    )

    database_url: str = DEFAULT_DB_URL
    auto_migrate: bool = False
    instance_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    api_token: SecretStr | None = None
    engine: EngineSettings = Field(default_factory=EngineSettings)
    probes: ProbeSettings = Field(default_factory=ProbeSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    alerts: AlertSettings = Field(default_factory=AlertSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    report: ReportSettings = Field(default_factory=ReportSettings)

    @field_validator("database_url")
    @classmethod
    def _url_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("database_url: must not be empty")
        return v

    @model_validator(mode="after")
    def _tokens(self) -> Settings:
        names: set[str] = set()
        for t in self.api.tokens:
            if not t.token.get_secret_value():
                raise ValueError(f"api.tokens: token {t.name!r} is empty")
            if not t.name.strip() or t.name in names or t.name in ("api-token", "anonymous"):
                # The name is the audit actor: it must say who, unambiguously.
                raise ValueError(f"api.tokens: name {t.name!r} is empty, repeated or reserved")
            names.add(t.name)
        return self

    def all_tokens(self) -> dict[str, str]:
        """Return actor name -> token for every configured token."""
        out = {t.name: t.token.get_secret_value() for t in self.api.tokens}
        if self.api_token is not None and self.api_token.get_secret_value():
            out.setdefault("api-token", self.api_token.get_secret_value())
        return out

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit arguments > environment > YAML file.
        return init_settings, env_settings, _YamlSource(settings_cls)


class _YamlSource(PydanticBaseSettingsSource):
    """Read the YAML file named by TAILWATCH_CONFIG (or passed as _config_file)."""

    path: str | None = None

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _YamlSource.path or os.environ.get("TAILWATCH_CONFIG")
        if not path:
            return {}
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file: {path} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file: {path} must hold a mapping")
        return data


def get_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Build settings from the environment, an optional YAML file and overrides."""
    _YamlSource.path = config_file
    try:
        return Settings(**overrides)
    finally:
        _YamlSource.path = None
