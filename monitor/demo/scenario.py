"""Set the stage (receiver, settings, service, traffic), play the steps, collect the outcome."""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from rich.console import Console

from monitor.demo.client import ServiceClient
from monitor.demo.context import StepContext
from monitor.demo.engine import DemoEngineFactory, models_present
from monitor.demo.errors import CheckFailed, DemoOptionError, DemoSetupError
from monitor.demo.narration import Narrator
from monitor.demo.outcome import DemoOutcome, StepResult
from monitor.demo.profile import FULL, DemoProfile, demo_settings
from monitor.demo.server import AnalysisProcess, ServiceThread
from monitor.demo.steps import STEPS
from monitor.demo.traffic import TrafficGenerator
from monitor.loopback import WebhookReceiver
from monitor.settings import Settings

log = logging.getLogger(__name__)
DB_NAME = "tailwatch-demo.db"


@dataclass(frozen=True)
class DemoOptions:
    """How to run the demo.

    keep_dir: keep the database, rule/policy files, webhook log, demo log and report
        here (emptied of an earlier demo's database first); None: a temporary directory,
        removed at the end, and the report under ./var/reports.
    fake_engine: serve probes.fake.FakeEngine instead of the built-in models.
    """

    profile: DemoProfile = FULL
    keep_dir: Path | None = None
    fake_engine: bool = False
    report_dir: Path | None = None


def _workdir(options: DemoOptions) -> Path:
    if options.keep_dir is None:
        return Path(tempfile.mkdtemp(prefix="tailwatch-demo-"))
    d = options.keep_dir
    if d.exists() and not d.is_dir():
        raise DemoOptionError("keep", f"{d} exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", "webhooks.jsonl", "demo.log",
                 "worker.log"):
        (d / name).unlink(missing_ok=True)  # a fresh run: no earlier baselines or alerts
    return d


_CHATTY = ("httpx", "apscheduler.executors")  # a line per request / per job run


def _quiet(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or not record.name.startswith(_CHATTY)


def _log_to(path: Path) -> tuple[logging.Handler, int]:
    """Send INFO and up to `path` (without per-request chatter); return the old root level."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_quiet)
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return handler, old


def run_demo(options: DemoOptions | None = None, console: Console | None = None) -> DemoOutcome:
    """Run the scripted scenario end to end and return what happened.

    Raises DemoSetupError when the built-in models are missing (and no fake engine was
    asked for), DemoOptionError for a bad keep directory.
    """
    options = options or DemoOptions()
    console = console or Console()
    if not options.fake_engine and not models_present():
        raise DemoSetupError("the built-in models are missing (engine/builtin/target and "
                             "draft): run the engine's training first, or pass --fake-engine")
    workdir = _workdir(options)
    report_dir = options.report_dir or (workdir / "reports" if options.keep_dir is not None
                                        else Path("var/reports"))
    handler, old_level = _log_to(workdir / "demo.log")
    started = time.monotonic()
    try:
        with WebhookReceiver(log_file=workdir / "webhooks.jsonl") as receiver:
            outcome = _play(options, console, workdir, report_dir, receiver, started)
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(old_level)
        handler.close()
    if options.keep_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
        return replace(outcome, workdir=None)
    return outcome


def report_runner(app: FastAPI, settings: Settings,
                  written: list[Path]) -> Callable[[], tuple[str, str]]:
    """Return the report step's writer: this week's report of `app`'s database.

    It returns the (markdown, HTML) paths, or empty strings when a file is missing or
    empty, and appends the markdown path to `written`.
    """
    from monitor.hub import services_of
    from monitor.report.job import run_weekly_report
    from monitor.report.week import week_of

    def run_report() -> tuple[str, str]:
        out = run_weekly_report(services_of(app).sessions, settings,
                                week=week_of(datetime.now(UTC)))
        written.append(out.markdown_path)
        ok = all(p.is_file() and p.stat().st_size > 0 for p in (out.markdown_path, out.html_path))
        return (str(out.markdown_path), str(out.html_path)) if ok else ("", "")

    return run_report


def _play(options: DemoOptions, console: Console, workdir: Path, report_dir: Path,
          receiver: WebhookReceiver, started: float) -> DemoOutcome:
    from monitor.app import create_app

    profile = options.profile
    token = secrets.token_urlsafe(24)
    settings = demo_settings(profile, workdir, receiver_url=receiver.url,
                             report_dir=report_dir, token=token)
    factory = DemoEngineFactory(fake=options.fake_engine)
    app = create_app(settings, engine_factory=factory, analysis_in_process=False)
    results: list[StepResult] = []
    alerts: list[dict[str, Any]] = []
    changes: list[dict[str, Any]] = []
    report: list[Path] = []

    run_report = report_runner(app, settings, report)
    with Narrator(console, steps=len(STEPS)) as say:
        say.say(f"[bold]tailwatch demo[/bold] ({profile.name}: buckets {list(profile.buckets)}, "
                f"{profile.canaries_per_bucket} canary/bucket every {profile.probe_interval_s:g}s, "
                f"rule cycles {profile.window_s:g}s, compile backend {profile.compile_backend!r}"
                f"{', fake engine' if options.fake_engine else ''}); files in {workdir}")
        try:
            service = ServiceThread(app).__enter__()
        except DemoSetupError:
            raise
        except Exception as exc:  # start-up errors (schema, rules) arrive here
            raise DemoSetupError(f"the service did not start: {type(exc).__name__}: {exc}") from exc
        try:
            worker = AnalysisProcess(settings, service.port, workdir).__enter__()
        except BaseException:
            service.__exit__(None, None, None)
            raise
        say.say(f"service on {service.url}; analysis worker pid {worker.pid}; "
                f"webhook receiver on {receiver.url}")
        api = ServiceClient(service.url, token=token)
        traffic = TrafficGenerator(service.url, rate_per_s=profile.traffic_rate_per_s)
        ctx = StepContext(profile=profile, api=api, traffic=traffic, receiver=receiver,
                          engine=lambda: factory.engine, say=say, run_report=run_report,
                          rollout=lambda: factory.rollout)
        try:
            failed = False
            for number, (name, story, play) in enumerate(STEPS, start=1):
                if failed:
                    results.append(StepResult(number, name, False, skipped=True,
                                              error="skipped after a failed step"))
                    continue
                results.append(_step(ctx, say, number, name, story, play))
                failed = not results[-1].passed
        finally:
            traffic.stop()
            try:
                alerts = sorted(api.alerts("all"), key=lambda a: a["started_at"])
                changes = list(reversed(api.audit()))
            except Exception as exc:  # noqa: BLE001 - the summary is best effort
                log.warning("demo: could not read alerts/audit for the summary: %s", exc)
            api.close()
            say.waiting("stopping the service")
            worker.__exit__(None, None, None)
            service.__exit__(None, None, None)
    return DemoOutcome(profile=profile.name, steps=tuple(results),
                       duration_s=time.monotonic() - started, planned=len(STEPS),
                       workdir=workdir,
                       report_path=report[0] if report else None, alerts=tuple(alerts),
                       flag_changes=tuple(changes))


def _step(ctx: StepContext, say: Narrator, number: int, name: str, story: str,
          play: Any) -> StepResult:
    ctx.step_name, ctx.events, ctx.headline = f"step {number} ({name})", [], ""
    say.step(number, name, story)
    began = say.elapsed()
    error = None
    try:
        play(ctx)
    except CheckFailed as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken step fails the demo, with its reason
        log.error("demo step %s crashed:\n%s", name, traceback.format_exc())
        say.fail(f"step {number} crashed", "the step to complete", f"{type(exc).__name__}: {exc}")
        error = f"{type(exc).__name__}: {exc}"
    say.step_done()
    return StepResult(number, name, error is None, started_s=began,
                      duration_s=say.elapsed() - began, headline=ctx.headline,
                      events=tuple(ctx.events), error=error)
