"""Render a WeeklyReport as one self-contained HTML file (plots inline as data: URIs)."""

from __future__ import annotations

import base64
from html import escape

from monitor.report import sections
from monitor.report.markdown import NO_DATA_LINE
from monitor.report.model import WeeklyReport
from monitor.report.plots import Plot, render_plots
from monitor.report.sections import Block, Bullets, Heading, Item, Paragraph
from monitor.report.tables import Table, when

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
    for section in sections.SECTIONS:
        out += _section(section.title, section.build(report))
    out.append("<h2>Plots</h2>")
    if not plots:
        out.append("<p>No data to plot.</p>")
    for p in plots:
        uri = "data:image/png;base64," + base64.b64encode(p.png).decode("ascii")
        out.append(f'<figure><img class="plot" id="plot-{e(p.key)}" alt="{e(p.title)}" '
                   f'src="{uri}"><figcaption>{e(p.title)}</figcaption></figure>')
    out.append("</body></html>")
    return "\n".join(out)


def _section(title: str, blocks: tuple[Block, ...]) -> list[str]:
    """Return the section's lines; a table hangs off the heading or table it follows."""
    out = [f"<h2>{escape(title)}</h2>"]
    joins = True
    for block in blocks:
        html = _block(block)
        if joins and isinstance(block, Table):
            out[-1] += html
        else:
            out.append(html)
        joins = isinstance(block, Table)
    return out


def _block(block: Block) -> str:
    e = escape
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Heading):
        if block.status is None:
            return f"<h3>{e(block.text)}</h3>"
        return (f'<h3>{e(block.text)}: <span class="{_cls(block.status)}">'
                f"{e(block.status.upper())}</span></h3>")
    if isinstance(block, Paragraph):
        return f"<p>{e(block.text)}</p>"
    return _bullets(block)


def _bullets(block: Bullets) -> str:
    intro = f"<p>{escape(block.intro)}</p>" if block.intro else ""
    return intro + "<ul>" + "".join(f"<li>{_item(i)}</li>" for i in block.items) + "</ul>"


def _item(item: Item) -> str:
    if item.strong:
        return f"<strong>{escape(item.strong)}</strong> {escape(item.text)}"
    return escape(item.text)


def _table(t: Table) -> str:
    status_col = t.status_col
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
