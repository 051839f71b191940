"""`tailwatch worker`: run evaluation, delivery, retention and the report in their own process."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import click

from monitor.cli.config import load_settings
from monitor.logs import FORMATS, LEVELS, configure_logging

log = logging.getLogger(__name__)

# How long a stopping worker waits for a running job. A sensitivity run or an evaluation
# on a saturated host (the worker is niced) may take minutes: an orphaned worker, or one
# a process manager stops, must not linger that long. Leaving mid-job loses nothing: its
# transaction rolls back and runs again at the next start; a webhook in flight is sent
# again once its lease expires (delivery is at least once).
SHUTDOWN_GRACE_S = 10.0


def _exit_now(code: int) -> None:
    logging.shutdown()  # os._exit skips the handlers' flush
    os._exit(code)


def close_within(close: Callable[[], None], grace_s: float,
                 exit_process: Callable[[int], object] = _exit_now) -> bool:
    """Run `close`; past `grace_s`, log it and exit the process; return whether it ended."""
    closer = threading.Thread(target=close, name="tailwatch-worker-close", daemon=True)
    closer.start()
    closer.join(grace_s)
    if not closer.is_alive():
        return True
    log.warning("tailwatch worker: a job still runs %g s after the stop; exiting without it "
                "(its transaction rolls back; a webhook in flight is sent again)", grace_s)
    exit_process(0)
    return False


@click.command()
@click.option("--host", default=None, help="Bind address of /healthz and /metrics "
                                           "(worker.host, default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port of /healthz and /metrics (worker.port, default 8001).")
@click.option("--log-level", type=click.Choice(LEVELS), default=None,
              help="Log level (TAILWATCH_LOG_LEVEL, default info).")
@click.option("--log-format", type=click.Choice(FORMATS), default=None,
              help="Log lines as text or JSON objects (TAILWATCH_LOG_FORMAT, default text).")
@click.option("--exit-with-parent", is_flag=True, hidden=True,
              help="Exit when stdin closes or the parent exits (`serve` starts its worker so).")
@click.pass_context
def worker(ctx: click.Context, host: str | None, port: int | None, log_level: str | None,
           log_format: str | None, exit_with_parent: bool) -> None:
    """Run the leader-locked analysis jobs (no engine) until interrupted."""
    from monitor.cli.serve import startup_error
    from monitor.database import preflight
    from monitor.parent_watch import ParentWatch
    from monitor.priority import lower_session_priority
    from monitor.worker import AnalysisWorker

    settings = load_settings(ctx)
    if host is not None:
        settings = settings.model_copy(update={
            "worker": settings.worker.model_copy(update={"host": host})})
    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if not settings.scheduler.enabled:
        raise click.ClickException("scheduler.enabled: false leaves the worker nothing to run")
    stop = threading.Event()
    watch = ParentWatch(sys.stdin.buffer, lambda _why: stop.set()) if exit_with_parent else None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if watch is not None:
        watch.start()  # before start-up: a worker waiting for a locked database stops too
    # `serve` starts this process in a session of its own: its autogroup then competes with
    # serve's as a whole, and only its own nice value makes it yield.
    lower_session_priority(settings.worker.nice)
    analysis = AnalysisWorker(settings, port=port)
    try:
        preflight(settings, probes=False, stop=stop)
        analysis.start(stop)
    except Exception as exc:
        if stop.is_set():
            return  # asked to stop while it waited for the database: not a failure
        raise click.ClickException(startup_error(settings, exc)) from None
    try:
        while not stop.wait(0.5):  # a timed wait: signal handlers run between waits
            pass
    finally:
        close_within(analysis.close, SHUTDOWN_GRACE_S)
