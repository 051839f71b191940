"""`tailwatch serve`: run the HTTP service (API, probes, scheduler) in one process."""

from __future__ import annotations

import logging

import click

from monitor.cli.config import load_settings
from monitor.settings import Settings


def effective(settings: Settings, *, host: str | None, port: int | None, no_scheduler: bool,
              no_probes: bool) -> Settings:
    """Return `settings` with the command-line overrides applied."""
    api = settings.api.model_copy(update={k: v for k, v in (("host", host), ("port", port))
                                          if v is not None})
    sched = settings.scheduler.model_copy(update={
        "enabled": settings.scheduler.enabled and not no_scheduler,
        "probes_enabled": settings.scheduler.probes_enabled and not no_probes})
    return settings.model_copy(update={"api": api, "scheduler": sched})


@click.command()
@click.option("--host", default=None, help="Bind address (api.host, default 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port (api.port, default 8000).")
@click.option("--no-scheduler", is_flag=True, help="Serve the API only: no background jobs.")
@click.option("--no-probes", is_flag=True, help="Run the scheduler without canary probes.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
@click.pass_context
def serve(ctx: click.Context, host: str | None, port: int | None, no_scheduler: bool,
          no_probes: bool, log_level: str) -> None:
    """Serve the model, the operator API and /metrics until interrupted."""
    import uvicorn

    from monitor.app import create_app
    from monitor.service import preflight

    settings = effective(load_settings(ctx), host=host, port=port,
                         no_scheduler=no_scheduler, no_probes=no_probes)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
        # Fail here with one line rather than inside uvicorn's lifespan with a traceback.
        preflight(settings)
    except Exception as exc:
        from monitor.secrets import Masker

        raise click.ClickException(Masker.from_settings(settings).text(str(exc))) from None
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level=log_level,
                access_log=log_level == "debug")
