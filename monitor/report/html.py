"""Render a WeeklyReport as one self-contained HTML file (plots inline as data: URIs)."""

from __future__ import annotations

import base64
from html import escape

from monitor.report.deliveries import DEAD_LETTER_HOWTO, dead_letter_table
from monitor.report.incidents import incident_table
from monitor.report.markdown import NO_DATA_LINE
from monitor.report.model import WeeklyReport
from monitor.report.plots import Plot, render_plots
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

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:90%}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}
.s-holds{color:#176b2c;font-weight:bold}.s-violated{color:#b00020;font-weight:bold}
.s-at-risk{color:#a86400;font-weight:bold}.s-no-data{color:#777}
.nodata{background:#fff3cd;padding:1em;border:1px solid #e0c060}
figure{margin:1em 0}img{max-width:100%;border:1px solid #ddd}
"""
_STATUSES = ("holds", "violated", "at risk", "no data")


def render_html(report: WeeklyReport, plots: tuple[Plot, ...] | None = None) -> str:
    """Return the report as a standalone HTML document (no external resources)."""
    if plots is None:
        plots = render_plots(report.data, _acceptance_threshold(report))
    e = escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>Weekly assumption review {e(report.week)}</title>",
           f"<style>{_STYLE}</style></head><body>",
           f"<h1>Weekly assumption review {e(report.week)}</h1>",
           f"<p>Window: {e(report.window)}. Generated {e(when(report.generated_at))}.</p>"]
    if not report.has_data:
        out.append(f'<p class="nodata" id="no-data"><strong>{e(NO_DATA_LINE)}</strong> '
                   "No assumption could be checked; check that probes run and record into "
                   "this database.</p>")
    out.append("<p>Checks: " + ", ".join(f"{v} {e(k)}" for k, v in report.counts().items())
               + "</p>")
    out.append("<h2>Optimizations</h2>")
    for o in report.optimizations:
        out.append(f'<h3>{e(o.name)}: <span class="{_cls(o.status)}">{e(o.status.upper())}'
                   "</span></h3>")
        out.append(f"<p>Owner: {e(o.owner)}. {e(o.description)}</p>")
        out.append(f"<p>Expected speedup: {speed(o.expected_speedup)}; measured: "
                   f"{speed(o.measured_speedup)}.</p>")
        out.append(_table(check_rows(o), status_col=2))
        if o.disable_when:
            out.append("<p>Disable when:</p><ul>" + "".join(
                f"<li>{e(d.when)}: {e(d.action)}</li>" for d in o.disable_when) + "</ul>")
    out.append("<h2>Expected vs measured speedup</h2>" + _table(speedup_table(report)))
    out.append("<h2>Optimizations that cost more than they earn</h2>"
               + _table(costly_table(report)))
    out.append("<h2>Alerts</h2>" + _table(incident_table(report.data.incidents))
               + _table(alert_table(report)))
    out.append("<h2>Flag changes</h2>" + _table(flag_table(report)))
    out.append("<h2>Real-traffic shapes</h2>" + _table(shape_table(report)))
    out.append("<h2>Quality</h2>" + _table(quality_table(report.data.quality)))
    out.append("<h2>Rollouts</h2>" + _table(rollout_table(report.data.rollouts)))
    out.append("<h2>What this monitor can see</h2>"
               + _table(sensitivity_table(report.data.sensitivity)))
    out.append("<h2>Webhook dead letters</h2>"
               + _table(dead_letter_table(report.data.dead_letters)))
    if report.data.dead_letters:
        out.append(f"<p>{e(DEAD_LETTER_HOWTO)}</p>")
    out.append("<h2>Recommendations</h2>")
    if report.recommendations:
        out.append("<ul>" + "".join(f"<li><strong>{e(r.text)}</strong> ({e(r.evidence)})</li>"
                                    for r in report.recommendations) + "</ul>")
    else:
        out.append("<p>None.</p>")
    out.append("<h2>Plots</h2>")
    if not plots:
        out.append("<p>No data to plot.</p>")
    for p in plots:
        uri = "data:image/png;base64," + base64.b64encode(p.png).decode("ascii")
        out.append(f'<figure><img class="plot" id="plot-{e(p.key)}" alt="{e(p.title)}" '
                   f'src="{uri}"><figcaption>{e(p.title)}</figcaption></figure>')
    out.append("</body></html>")
    return "\n".join(out)


def _table(t: Table, status_col: int | None = None) -> str:
    if not t.rows:
        return f"<p><em>{escape(t.empty)}</em></p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in t.headers)
    body = []
    for row in t.rows:
        cells = []
        for i, c in enumerate(row):
            cls = ""
            if i == status_col and c.lower() in _STATUSES:
                cls = f' class="{_cls(c.lower())}"'
            cells.append(f"<td{cls}>{escape(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _cls(status: str) -> str:
    return "s-" + status.lower().replace(" ", "-")


def _acceptance_threshold(report: WeeklyReport) -> float | None:
    for o in report.optimizations:
        for c in o.checks:
            if c.assumption.metric == "acceptance_rate":
                return c.assumption.threshold
    return None
