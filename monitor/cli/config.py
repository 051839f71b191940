"""`tailwatch config show`: the effective settings as YAML, secrets masked.

`load_settings(ctx)` is the one way CLI commands build settings: a bad value or a
missing config file becomes one line and a non-zero exit.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import click
import yaml
from pydantic import ValidationError
from sqlalchemy.engine import make_url

from monitor.settings import Settings, get_settings

MASK = "**********"
# Whole key names (or their last `_`-separated word): "max_new_tokens" is not a secret.
_SECRET_KEY = re.compile(
    r"(^|_)(token|secret|password|passwd|authorization|api[_-]?key)$", re.I)


def load_settings(ctx: click.Context, **overrides: Any) -> Settings:
    """Return settings from the environment and --config; raise a one-line ClickException."""
    config_file = (ctx.find_root().obj or {}).get("config_file")
    try:
        return get_settings(config_file, **overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "settings"
        raise click.ClickException(f"invalid settings: {where}: {first.get('msg')}") from None
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"invalid settings: {exc}") from None


def masked(settings: Settings) -> dict[str, Any]:
    """Return the settings as plain data with every secret replaced by a mask."""
    data = settings.model_dump(mode="json")
    data["database_url"] = _mask_url(settings.database_url)
    return _mask(data)


def _mask_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return MASK


def _mask(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _mask(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v, key) for v in value]
    if value is not None and _SECRET_KEY.search(key) and not isinstance(value, bool):
        return MASK
    if isinstance(value, str) and key == "url":
        return _mask_webhook_url(value)
    return value


def _mask_webhook_url(url: str) -> str:
    # Slack-style webhook URLs carry their secret in the path or query: show the host only.
    parts = urlsplit(url)
    if not parts.scheme or not parts.hostname:
        return MASK
    port = f":{parts.port}" if parts.port else ""
    hidden = "/***" if parts.path.strip("/") or parts.query else ""
    return f"{parts.scheme}://{parts.hostname}{port}{hidden}"


@click.group()
def config() -> None:
    """Inspect the effective settings."""


@config.command("show")
@click.pass_context
def show(ctx: click.Context) -> None:
    """Print the effective settings as YAML (secrets masked)."""
    settings = load_settings(ctx)
    click.echo(yaml.safe_dump(masked(settings), sort_keys=False), nl=False)
