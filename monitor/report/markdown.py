"""Render a WeeklyReport as Markdown."""

from __future__ import annotations

from monitor.report.deliveries import DEAD_LETTER_HOWTO, dead_letter_table
from monitor.report.incidents import incident_table
from monitor.report.model import WeeklyReport
from monitor.report.quality import quality_table
from monitor.report.rollouts import rollout_table
from monitor.report.sensitivity import sensitivity_table
from monitor.report.tables import (
    Table,
    alert_table,
    check_rows,
    costly_table,
    flag_table,
    shape_table,
    speed,
    speedup_table,
    when,
)

NO_DATA_LINE = "No data: nothing was recorded in this week's window."


def render_markdown(report: WeeklyReport) -> str:
    """Return the report as a Markdown document."""
    out = [f"# Weekly assumption review {report.week}", "",
           f"Window: {report.window}. Generated {when(report.generated_at)}.", ""]
    if not report.has_data:
        out += [f"**{NO_DATA_LINE}**", "",
                "No assumption could be checked; check that probes run and record into this "
                "database.", ""]
    counts = report.counts()
    out += ["Checks: " + ", ".join(f"{v} {k}" for k, v in counts.items()), ""]
    out += ["## Optimizations", ""]
    for o in report.optimizations:
        out += [f"### {o.name}: {o.status.upper()}", "",
                f"Owner: {o.owner}. {o.description}".rstrip(), "",
                f"Expected speedup: {speed(o.expected_speedup)}; measured: "
                f"{speed(o.measured_speedup)}.", ""]
        out += _table(check_rows(o))
        if o.disable_when:
            out += ["Disable when:", ""]
            out += [f"- {d.when}: {d.action}" for d in o.disable_when]
            out.append("")
    out += ["## Expected vs measured speedup", ""] + _table(speedup_table(report))
    out += ["## Optimizations that cost more than they earn", ""] + _table(costly_table(report))
    out += ["## Alerts", ""] + _table(incident_table(report.data.incidents))
    out += _table(alert_table(report))
    out += ["## Flag changes", ""] + _table(flag_table(report))
    out += ["## Real-traffic shapes", ""] + _table(shape_table(report))
    out += ["## Quality", ""] + _table(quality_table(report.data.quality))
    out += ["## Rollouts", ""] + _table(rollout_table(report.data.rollouts))
    out += ["## What this monitor can see", ""] + _table(sensitivity_table(report.data.sensitivity))
    out += ["## Webhook dead letters", ""] + _table(dead_letter_table(report.data.dead_letters))
    if report.data.dead_letters:
        out += [DEAD_LETTER_HOWTO, ""]
    out += ["## Recommendations", ""]
    if report.recommendations:
        out += [f"- **{r.text}** ({r.evidence})" for r in report.recommendations]
    else:
        out.append("None.")
    out.append("")
    return "\n".join(out)


def _table(t: Table) -> list[str]:
    if not t.rows:
        return [f"_{t.empty}_", ""]
    lines = ["| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    for row in t.rows:
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
