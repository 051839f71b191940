"""`tailwatch probe --once`: run one canary cycle now, store it, print a summary."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from engine.protocol import Engine
    from monitor.settings import Settings
    from probes.cycle import CycleResult


def load_engine(settings: Settings) -> Engine:
    """Build and warm the engine settings describe (tests replace this)."""
    import engine

    eng = engine.load_engine(settings.engine)
    eng.warm_up(background=False)
    return eng


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@click.command("probe")
@click.option("--once", is_flag=True, help="Run one cycle now (required: the service schedules cycles).")
@click.option("--suite", default=None, help="Canary suite (default: probes.suite).")
@click.option("--ab/--no-ab", default=None, help="Force the A/B fallback arms on or off.")
@click.option("--json", "as_json", is_flag=True, help="Print the cycle as JSON.")
@click.pass_context
def probe(ctx: click.Context, once: bool, suite: str | None, ab: bool | None,
          as_json: bool) -> None:
    """Run one probe cycle through the engine and store it."""
    from sqlalchemy.exc import SQLAlchemyError

    from engine.errors import EngineError
    from monitor.cli.config import load_settings
    from monitor.prober import build_prober
    from probes.canaries import load_suites
    from probes.errors import ProbeError
    from storage import make_engine, make_sessionmaker
    from storage.errors import StorageError
    from storage.migrate import check_schema
    from storage.writer import Writer

    if not once:
        raise click.UsageError("pass --once (the service runs probe cycles on its schedule)")
    settings = load_settings(ctx)
    db = make_engine(settings.database_url)
    try:
        try:
            check_schema(db)
        except (StorageError, SQLAlchemyError) as exc:
            raise click.ClickException(_one_line(exc)) from exc
        try:
            suites = load_suites(settings.probes.suites_file)
        except ProbeError as exc:
            raise click.ClickException(f"canary suites: {exc}") from exc
        name = suite or settings.probes.suite
        if name not in suites:
            raise click.BadParameter(
                f"unknown suite {name!r}; known: {', '.join(sorted(suites))}",
                param_hint="--suite")
        try:
            eng = load_engine(settings)
        except (EngineError, ValueError, OSError) as exc:
            raise click.ClickException(f"engine: {_one_line(exc)}") from exc
        # The service's write path: the cycle's rows go through the storage Writer.
        sessions = make_sessionmaker(db)
        writer = Writer(sessions, initial_backoff_s=0.05, max_backoff_s=0.5)
        try:
            # The service's composition: the same output checker compares outputs.
            probes = settings.probes.model_copy(update={"suite": name})
            prober = build_prober(settings.model_copy(update={"probes": probes}), eng, writer,
                                  sessions, suites=suites)
            result = prober.run_cycle(name, ab=ab)
        finally:
            eng.close()
            left = writer.close(timeout=10.0)
        stats = writer.stats
        if left or stats.failed or stats.dropped:
            raise click.ClickException("database: the probe cycle could not be stored: "
                                       f"{stats.last_error or 'writer closed'}")
    finally:
        db.dispose()
    click.echo(json.dumps(to_json(result), indent=2) if as_json else summary(result))
    if result.status != "ok":
        ctx.exit(1)


def to_json(result: CycleResult) -> dict[str, Any]:
    """Return the cycle as JSON-ready data (timestamps ISO 8601)."""
    data = asdict(result)
    data["started_at"] = result.started_at.isoformat()
    data["finished_at"] = result.finished_at.isoformat()
    data["duration_s"] = result.duration_s
    data["rss_growth_bytes"] = result.rss_growth_bytes
    for g, out in zip(result.groups, data["groups"], strict=True):
        out["acceptance_rate"] = g.acceptance_rate
    return data


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def summary(result: CycleResult) -> str:
    """Return a plain-text table: one line per bucket x path x decoding x variant."""
    head = (f"probe cycle {result.status} suite={result.suite} instance={result.instance_id}"
            f" {result.duration_s:.1f}s ab={'yes' if result.ab else 'no'}")
    lines = [head]
    if result.error:
        lines.append(f"error: {result.error}")
    cols = ("bucket", "path", "decoding", "variant", "n", "p50ms", "p95ms", "p99ms", "maxms",
            "ttft50ms", "tok50ms", "accept", "waste")
    rows = [cols]
    for g in result.groups:
        acc = "-" if g.acceptance_rate is None else f"{g.acceptance_rate:.2f}"
        rows.append((g.bucket, g.path, g.decoding, g.variant, str(g.requests),
                     _ms(g.latency.p50), _ms(g.latency.p95), _ms(g.latency.p99),
                     _ms(g.latency.max), _ms(g.ttft.p50), _ms(g.per_token.p50), acc,
                     f"{g.padding_waste:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    c = result.compile
    recompiles = "-" if c is None else str(c.recompiles)
    reasons = "" if c is None or not c.recompile_reasons else \
        " (" + "; ".join(f"{k} x{v}" for k, v in c.recompile_reasons.items()) + ")"
    growth = result.rss_growth_bytes
    lines.append(f"recompiles: {recompiles}{reasons}")
    lines.append("memory growth: " + ("-" if growth is None else f"{growth / 2**20:+.1f} MiB RSS"))
    if result.rejected:
        lines.append(f"rejected canaries: {result.rejected}")
    if result.missing_buckets:
        lines.append("buckets without canaries: " + ", ".join(result.missing_buckets))
    return "\n".join(lines)
