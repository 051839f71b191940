"""`tailwatch canaries build`: canary suites from your own sample texts, for your tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from monitor.cli.config import load_settings


@click.group()
def canaries() -> None:
    """Build canary suites for the configured model."""


@canaries.command("build")
@click.option("--from", "samples_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Sample texts, one per line (cut or joined to fit every bucket).")
@click.option("--per-bucket", type=click.IntRange(1, 1000), default=8, show_default=True,
              help="Canaries per bucket.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("suites.yaml"), show_default=True, help="Suites file to write.")
@click.option("--name", default="own", show_default=True,
              help="Suite name (the held-out suite is NAME_heldout).")
@click.option("--holdout", type=click.FloatRange(0.0, 0.9), default=0.2, show_default=True,
              help="Share of the samples held out into NAME_heldout.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.pass_context
def build(ctx: click.Context, samples_file: Path, per_bucket: int, out_file: Path, name: str,
          holdout: float, force: bool) -> None:
    """Build canaries covering every bucket, with reference outputs, into --out.

    The reference outputs come from the reference path: the configured model, eager,
    float32, direct decoding, exact input shape. Use the file with
    `probes.suites_file: <out>` and `probes.suite: <name>`.
    """
    from engine.errors import EngineError
    from probes.canary_builder import build_suites, suites_yaml

    settings = load_settings(ctx)
    if out_file.exists() and not force:
        raise click.ClickException(f"{out_file} exists (pass --force to replace it)")
    if not name.strip() or any(c.isspace() for c in name):
        raise click.BadParameter("must be a non-empty word", param_hint="--name")
    try:
        lines = samples_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"{samples_file}: cannot read ({exc})") from None
    config = dataclasses.replace(settings.engine, compile_mode="off",
                                 dtype="float32", use_draft=False, max_concurrency=1)
    try:
        import engine as engine_pkg

        eng = engine_pkg.load_engine(config)
    except (EngineError, ValueError, OSError) as exc:
        raise click.ClickException(f"engine: {str(exc).strip().splitlines()[0]}") from None
    try:
        result = build_suites(lines, eng, name=name, per_bucket=per_bucket, holdout=holdout,
                              max_new_tokens=settings.engine.max_new_tokens)
    except ValueError as exc:
        raise click.ClickException(f"{samples_file}: {exc}") from None
    finally:
        eng.close()
    header = (f"Built by `tailwatch canaries build --from {samples_file.name}` for model"
              f" {eng.info.model_version}, buckets {','.join(map(str, eng.info.buckets))}.\n"
              "Reference outputs: eager, float32, direct decoding, exact input shape.")
    out_file.write_text(suites_yaml(result.suites, header), encoding="utf-8")
    for suite in result.suites:
        counts = result.coverage[suite.name]
        click.echo(f"{suite.name}: " + ", ".join(f"{b}: {n}" for b, n in counts.items())
                   + " canaries per bucket")
    click.echo(f"wrote {out_file}; use it with probes.suites_file: {out_file} and"
               f" probes.suite: {name}")
    uncovered = result.missing.get(name, ())
    if uncovered:
        raise click.ClickException(f"no canary could be cut for bucket(s) {', '.join(uncovered)}"
                                   f" from {samples_file}")
