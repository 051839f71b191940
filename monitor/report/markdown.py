"""Render a WeeklyReport as Markdown."""

from __future__ import annotations

from monitor.report import sections
from monitor.report.model import WeeklyReport
from monitor.report.sections import Block, Heading, Item, Paragraph
from monitor.report.tables import Table, when

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
    for section in sections.SECTIONS:
        out += [f"## {section.title}", ""]
        for block in section.build(report):
            out += _block(block)
    return "\n".join(out)


def _block(block: Block) -> list[str]:
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Heading):
        status = f": {block.status.upper()}" if block.status is not None else ""
        return [f"### {block.text}{status}", ""]
    if isinstance(block, Paragraph):
        # Trailing spaces are a line break in Markdown.
        return [block.text.rstrip(), ""]
    intro = [block.intro, ""] if block.intro else []
    return intro + [_item(i) for i in block.items] + [""]


def _item(item: Item) -> str:
    return f"- **{item.strong}** {item.text}" if item.strong else f"- {item.text}"


def _table(t: Table) -> list[str]:
    if not t.rows:
        return [f"_{t.empty}_", ""]
    lines = ["| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    for row in t.rows:
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
