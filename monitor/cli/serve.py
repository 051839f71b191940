"""`tailwatch serve`: run the HTTP service (engine, API, probes) and its analysis worker.

The serving process keeps the engine, the API, probes and traffic recording; evaluation,
delivery, retention and the report run in a `tailwatch worker` child (restarted when it
dies, stopped with `serve`). `--no-worker` leaves them to a worker run elsewhere (replicas).
"""

from __future__ import annotations

import errno
import signal
import socket
from types import FrameType
from typing import TYPE_CHECKING

import click

from monitor.cli.config import load_settings
from monitor.logs import FORMATS, LEVELS, configure_logging
from monitor.settings import Settings

if TYPE_CHECKING:
    from monitor.supervisor import WorkerSupervisor


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
@click.option("--no-worker", is_flag=True,
              help="Start no analysis worker: a `tailwatch worker` deployed on its own runs "
                   "evaluation, delivery, retention and the report.")
@click.option("--log-level", type=click.Choice(LEVELS), default=None,
              help="Log level (TAILWATCH_LOG_LEVEL, default info).")
@click.option("--log-format", type=click.Choice(FORMATS), default=None,
              help="Log lines as text or JSON objects (TAILWATCH_LOG_FORMAT, default text).")
@click.pass_context
def serve(ctx: click.Context, host: str | None, port: int | None, no_scheduler: bool,
          no_probes: bool, no_worker: bool, log_level: str | None,
          log_format: str | None) -> None:
    """Serve the model, the operator API and /metrics until interrupted."""
    import uvicorn

    from monitor.app import create_app
    from monitor.database import preflight

    settings = effective(load_settings(ctx), host=host, port=port,
                         no_scheduler=no_scheduler, no_probes=no_probes)
    try:
        level, _ = configure_logging(log_level, log_format)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    # uvicorn starts the lifespan (engine, scheduler) before it binds: check the port first.
    check_port(settings.api.host, settings.api.port)
    with_worker = settings.scheduler.enabled and not no_worker
    if with_worker:
        check_port(settings.worker.host, settings.worker.port, field="worker.port")
    try:
        app = create_app(settings, analysis_in_process=False)
        # Fail here with one line rather than inside uvicorn's lifespan with a traceback.
        preflight(settings)
    except Exception as exc:
        raise click.ClickException(startup_error(settings, exc)) from None
    supervisor = start_worker(ctx, settings) if with_worker else None
    app.state.worker = supervisor  # /readyz reports it (monitor.api.deps)
    # uvicorn re-raises a SIGTERM it caught after its shutdown, to the handler found at
    # start: make that one unwind through `finally`, so the worker is stopped too.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        # log_config=None: uvicorn's lines go through the handler above (text or JSON).
        uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level=level,
                    log_config=None, access_log=level == "debug")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if supervisor is not None:
            supervisor.stop()


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def start_worker(ctx: click.Context, settings: Settings) -> WorkerSupervisor:
    """Start `serve`'s analysis worker child (restarted when it dies)."""
    from monitor.supervisor import WorkerSupervisor, health_url, worker_command, worker_env

    supervisor = WorkerSupervisor(worker_command(ctx.obj.get("config_file")),
                                  worker_env(settings),
                                  backoff_max_s=settings.worker.restart_backoff_max_s,
                                  health_url=health_url(settings.worker.host,
                                                        settings.worker.port))
    supervisor.start()
    return supervisor


def startup_error(settings: Settings, exc: Exception) -> str:
    """Return the one line `serve` prints for a start-up failure, every secret masked."""
    from monitor.database import one_line
    from monitor.secrets import UNPARSABLE_URL, Masker, mask_url

    text = one_line(str(exc)) or type(exc).__name__
    url = settings.database_url
    if url and mask_url(url) == UNPARSABLE_URL:
        # Its password cannot be located, so the masker does not know it: hide it whole.
        text = text.replace(url, UNPARSABLE_URL)
    return Masker.from_settings(settings).text(text)


def check_port(host: str, port: int, *, field: str = "api.port") -> None:
    """Raise a one-line ClickException when `host:port` cannot be bound (taken, or no such address)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        where = field.replace(".port", ".host")
        raise click.ClickException(f"{where}: cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"({exc.strerror})"
            raise click.ClickException(
                f"{field}: cannot listen on {host}:{port}: the address {why}") from None
