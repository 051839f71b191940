"""`tailwatch engine precompile`: compile and save the engine's functions before serving."""

from __future__ import annotations

import time

import click

from monitor.cli.config import load_settings


@click.group()
def engine() -> None:
    """Prepare the inference engine."""


@engine.command("precompile")
@click.option("--model-dir", default=None, help="Local HF T5 directory (default: configured).")
@click.option("--draft-dir", default=None, help="Draft model directory (default: configured).")
@click.option("--force", is_flag=True, help="Rebuild even when functions for this key are saved.")
@click.pass_context
def precompile_cmd(ctx: click.Context, model_dir: str | None, draft_dir: str | None,
                   force: bool) -> None:
    """Compile the functions every bucket shares once and save them for the server.

    Keyed on the weights, the optimization settings, torch and the device: when the
    functions for that key are saved it returns at once (unless --force).
    """
    from dataclasses import replace

    from engine.errors import EngineError
    from engine.runtime import Runtime  # the concrete runtime: saved functions are its business

    settings = load_settings(ctx)
    config = settings.engine
    if model_dir is not None:
        config = replace(config, model_dir=model_dir)
    if draft_dir is not None:
        config = replace(config, draft_dir=draft_dir)
    if config.compile_mode == "off":
        click.echo("engine.compile_mode is off: nothing to precompile")
        return
    start = time.perf_counter()
    try:
        runtime = Runtime(config)
    except (EngineError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        path = runtime.saved_dir
        if path is None:  # compile off for this model: nothing to keep
            click.echo("no compiled functions: nothing to precompile")
            return
        if runtime.precompiled() and not force:
            click.echo(f"compiled functions up to date: {path}")
            return
        # Each shared function is compiled once, ahead of time, and saved; the warm-up
        # then serves from those files (a function that could not be saved compiles).
        saved = runtime.save_compiled()
        runtime.warm_up(background=False)
        status = runtime.warmup_status()
        if status.error:
            raise click.ClickException(f"warm-up failed: {status.error}")
        from engine.precompile import dir_bytes

        size = dir_bytes(path)
    finally:
        runtime.close()
    snap = runtime.compile_snapshot()
    def many(n: int, what: str) -> str:
        return f"{n} {what}" + ("" if n == 1 else "s")

    click.echo(f"precompiled {status.warm_buckets} buckets ({many(snap.graphs, 'graph')}, "
               f"{many(saved, 'saved function')}; decode step: {runtime.step_kind}) in "
               f"{time.perf_counter() - start:.1f} s: {path} ({size / 2**20:.1f} MiB)")
