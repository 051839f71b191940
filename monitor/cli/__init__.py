"""The `tailwatch` command line.

Each command lives in its own module and is imported only when invoked, so
`tailwatch db upgrade` never pays for torch.
"""

from __future__ import annotations

import importlib
import sys

import click

# command name -> "module:attribute" (a click.Command)
COMMANDS: dict[str, str] = {
    "generate": "monitor.cli.generate:generate",
    "db": "monitor.cli.db:db",
    "probe": "monitor.cli.probe:probe",
    "serve": "monitor.cli.serve:serve",
    "worker": "monitor.cli.worker:worker",
    "config": "monitor.cli.config:config",
    "flags": "monitor.cli.operator:flags",
    "alerts": "monitor.cli.operator:alerts",
    "incidents": "monitor.cli.incidents:incidents",
    "baselines": "monitor.cli.operator:baselines",
    "report": "monitor.cli.report:report",
    "demo": "monitor.cli.demo:demo",
    "engine": "monitor.cli.engine:engine",
    "export": "monitor.cli.export:export",
    "canaries": "monitor.cli.canaries:canaries",
}


class LazyGroup(click.Group):
    """Import a subcommand's module only when it is run or listed in help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return None  # command not built yet
            raise
        return getattr(module, attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tailwatch", prog_name="tailwatch",
                      message="%(prog)s %(version)s")
@click.option("--config", "config_file", envvar="TAILWATCH_CONFIG", default=None,
              help="YAML settings file (TAILWATCH_CONFIG).")
@click.pass_context
def cli(ctx: click.Context, config_file: str | None) -> None:
    """Serve an optimized T5 and watch its optimizations."""
    ctx.ensure_object(dict)
    ctx.obj["config_file"] = config_file


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    try:
        rv = cli.main(args=argv, prog_name="tailwatch", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 1
    # In non-standalone mode click returns ctx.exit(n)'s code instead of raising.
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
