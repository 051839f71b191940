"""`tailwatch config show`: the effective settings as YAML, secrets masked.

`load_settings(ctx)` is the one way CLI commands build settings: a bad value or a
missing config file becomes one line and a non-zero exit.
"""

from __future__ import annotations

from typing import Any

import click
import yaml
from pydantic import ValidationError

from monitor.secrets import Masker
from monitor.settings import Settings, get_settings


def load_settings(ctx: click.Context, **overrides: Any) -> Settings:
    """Return settings from the environment and --config; raise a one-line ClickException."""
    config_file = (ctx.find_root().obj or {}).get("config_file")
    try:
        return get_settings(config_file, **overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first.get("msg", "")).removeprefix("Value error, ")
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise click.ClickException(f"invalid settings: {where + ': ' if where else ''}"
                                   f"{message}") from None
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"invalid settings: {exc}") from None


def masked(settings: Settings) -> dict[str, Any]:
    """Return the settings as plain data with every secret replaced by a mask."""
    return Masker.from_settings(settings).data(settings.model_dump(mode="json"))


@click.group()
def config() -> None:
    """Inspect the effective settings."""


@config.command("show")
@click.pass_context
def show(ctx: click.Context) -> None:
    """Print the effective settings as YAML (secrets masked)."""
    settings = load_settings(ctx)
    click.echo(yaml.safe_dump(masked(settings), sort_keys=False), nl=False)
