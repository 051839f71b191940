"""`tailwatch demo`: play the whole monitoring loop on this machine, checked step by step."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--fast", is_flag=True,
              help="Shortened form (3 buckets instead of 5, 10 s rule cycles): the end-to-end test.")
@click.option("--keep", "keep_dir", default=None, type=click.Path(path_type=Path),
              metavar="DIR", help="Keep the database, webhook log, demo log and report in DIR.")
@click.option("--fake-engine", is_flag=True, hidden=True,
              help="Serve the torch-free fake engine (for developing the scenario).")
@click.pass_context
def demo(ctx: click.Context, fast: bool, keep_dir: Path | None, fake_engine: bool) -> None:
    """Start the service with accelerated schedules and play a scripted incident scenario.

    Exits 0 only when every step behaved as scripted; a failed check prints what was
    expected and what was seen.
    """
    from rich.console import Console

    from monitor.demo import FAST, FULL, DemoError, DemoOptionError, DemoOptions, run_demo
    from monitor.demo.narration import print_summary

    console = Console()
    options = DemoOptions(profile=FAST if fast else FULL, keep_dir=keep_dir,
                          fake_engine=fake_engine)
    try:
        outcome = run_demo(options, console)
    except (DemoError, DemoOptionError) as exc:
        raise click.ClickException(str(exc)) from None
    extra = [f"took {outcome.duration_s:.0f} s"]
    if outcome.report_path is not None:
        extra.append(f"weekly report: {outcome.report_path}")
    if outcome.workdir is not None:
        extra.append(f"kept: {outcome.workdir} (database, webhooks.jsonl, demo.log, worker.log)")
    failed = [s for s in outcome.steps if not s.passed and not s.skipped]
    extra.append("[green]every step behaved as scripted[/green]" if outcome.passed else
                 f"[red]demo failed[/red]: {failed[0].error if failed else 'incomplete'}")
    print_summary(console, outcome, extra)
    ctx.exit(outcome.exit_code)
