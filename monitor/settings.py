"""Typed settings from TAILWATCH_* environment variables and an optional YAML file.

Built by `get_settings()`, never at import. Nested fields use `__` in environment
variables: TAILWATCH_ENGINE__COMPILE_MODE=off. Each package owns one section.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml
from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from alerts.settings import AlertSettings
from engine.config import EngineConfig
from probes.settings import ProbeSettings, QualitySettings

DEFAULT_DB_URL = "sqlite:///./var/tailwatch.db"

__all__ = ["AlertSettings", "ApiSettings", "EngineSettings", "ProbeSettings",
           "RetentionSettings", "SchedulerSettings", "Settings", "WorkerSettings", "get_settings"]


# Each package owns its section's type: the engine's is its frozen EngineConfig itself
# (pydantic validates the dataclass, so new EngineConfig fields are settings with no edit
# here), probes' and alerts' are pydantic models next to the code that reads them.
EngineSettings = EngineConfig


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
    # Each process hands glibc's free heap pages back to the kernel this often (0: never).
    memory_trim_interval_s: float = Field(60.0, ge=0)


class RetentionSettings(BaseModel):
    """How long data is kept."""

    raw_days: int = 14
    rollup_days: int = 90


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
    max_body_bytes: int | None = Field(None, gt=0)  # None: sized from engine.max_input_tokens


class WorkerSettings(BaseModel):
    """`tailwatch worker`: the analysis process (evaluation, delivery, retention, report)."""

    host: str = "127.0.0.1"
    port: int = Field(8001, ge=0, le=65535)  # its /healthz and /metrics (0: any free port)
    restart_backoff_max_s: float = Field(60.0, gt=0)  # `serve` restarts a crashed worker
    # The analysis jobs' threads run at this nice value (monitor.priority): they yield the
    # CPU to the engine, the API and the canaries. 0 leaves them at the process's own.
    nice: int = Field(10, ge=0, le=19)


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
    # Probe rows, rollups and compile events wait here while the database is down.
    write_buffer_max: int = Field(10_000, ge=1)
    # Stable across restarts (no pid): a restarted replica keeps its alerts and series.
    instance_id: str = Field(default_factory=socket.gethostname)
    api_token: SecretStr | None = None
    engine: EngineConfig = Field(default_factory=EngineConfig)
    probes: ProbeSettings = Field(default_factory=ProbeSettings)
    quality: QualitySettings = Field(default_factory=QualitySettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    alerts: AlertSettings = Field(default_factory=AlertSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    report: ReportSettings = Field(default_factory=ReportSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        # Nested sections ignore unknown keys on their own (EngineConfig is a dataclass):
        # refuse them here, once, for every source, and read "16,32" lists from env vars.
        return check_keys(data, cls) if isinstance(data, Mapping) else data

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
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ValueError(f"config file {path}: {where}{problem}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file: {path} must hold a mapping")
        try:
            check_keys(data, Settings)
        except UnknownSetting as exc:
            raise ValueError(f"config file {path}: {exc}") from None
        return data


def get_settings(config_file: str | None = None, **overrides: Any) -> Settings:
    """Build settings from the environment, an optional YAML file and overrides."""
    check_environment(os.environ)
    _YamlSource.path = config_file
    try:
        return Settings(**overrides)
    finally:
        _YamlSource.path = None


ENV_PREFIX = "TAILWATCH_"
# TAILWATCH_* variables that are no settings: read by the CLI, the logging set-up or tests.
OTHER_VARIABLES = frozenset({"CONFIG", "URL", "LOG_LEVEL", "LOG_FORMAT"})
_TEST_VARIABLES = "TEST_"


class UnknownSetting(ValueError):
    """A settings key or TAILWATCH_* variable names no setting."""


def _section(annotation: Any) -> type | None:
    # The model or dataclass a field holds (through `X | None`), else None.
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and (issubclass(t, BaseModel) or dataclasses.is_dataclass(t)):
            return t
    return None


def _fields(section: type) -> dict[str, Any]:
    if issubclass(section, BaseModel):
        return {name: f.annotation for name, f in section.model_fields.items()}
    hints = get_type_hints(section)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(section)}  # type: ignore[arg-type]


def _is_collection(annotation: Any) -> bool:
    for t in (annotation, *get_args(annotation)):
        if get_origin(t) in (list, tuple, set, frozenset) or t in (list, tuple, set, frozenset):
            return True
    return False


def _unknown(key: str, known: list[str], render: Any = str) -> UnknownSetting:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = (f"did you mean {render(close[0])}?" if close
            else f"valid here: {', '.join(render(k) for k in sorted(known))}")
    return UnknownSetting(f"unknown setting {render(key)}; {hint}")


def _list_value(text: str) -> Any:
    # Env values are strings: JSON ("[16, 32]") or a comma list ("16,32").
    try:
        return json.loads(text)
    except ValueError:
        return [part.strip() for part in text.split(",") if part.strip()]


def check_keys(data: Mapping[str, Any], section: type, path: str = "") -> dict[str, Any]:
    """Return `data` with string lists parsed; raise UnknownSetting on a key no field has
    and ValueError on a bool given to a dataclass section's int field."""
    known = _fields(section)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise _unknown(f"{path}{key}", [f"{path}{k}" for k in known])
        annotation = known[key]
        sub = _section(annotation)
        if sub is not None and isinstance(value, str) and value.strip().startswith("{"):
            value = json.loads(value)
        if sub is not None and isinstance(value, Mapping):
            value = check_keys(value, sub, f"{path}{key}.")
        elif isinstance(value, str) and _is_collection(annotation):
            value = _list_value(value)
        elif isinstance(value, bool) and annotation is int and dataclasses.is_dataclass(section):
            # pydantic reads `true` as 1 for a dataclass's int field (EngineConfig) before
            # the dataclass's own checks run: only here is it still a bool.
            raise ValueError(f"{path}{key}: must be a whole number, got {value!r}")
        out[key] = value
    return out


def check_environment(environ: Mapping[str, str]) -> None:
    """Raise UnknownSetting naming the first TAILWATCH_* variable that sets nothing."""
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].upper()
        if rest in OTHER_VARIABLES or rest.startswith(_TEST_VARIABLES):
            continue
        section: type | None = Settings
        parts = rest.lower().split("__")
        for i, part in enumerate(parts):
            known = _fields(section) if section is not None else {}
            if part not in known:
                prefix = parts[:i]
                env = [ENV_PREFIX + "__".join([*prefix, k]).upper() for k in known]
                env += [ENV_PREFIX + v for v in OTHER_VARIABLES] if i == 0 else []
                raise _unknown(name.upper(), env)
            section = _section(known[part])
            if section is None:
                break  # a leaf (or a list of them): the rest is its value's business
