"""The report's sections in order: each a title and the function that builds its content.

Both renderers (Markdown and HTML) walk SECTIONS, so a section is added, moved or
retitled here once. A section's content is a tuple of plain blocks (tables.Table, Heading,
Paragraph, Bullets) that each renderer knows how to write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from monitor.report.deliveries import DEAD_LETTER_HOWTO, dead_letter_table
from monitor.report.incidents import incident_table
from monitor.report.model import OptimizationReview, WeeklyReport
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
)


@dataclass(frozen=True)
class Heading:
    """A sub-heading inside a section; status, when set, follows the text and is styled."""

    text: str
    status: str | None = None


@dataclass(frozen=True)
class Paragraph:
    """One paragraph of plain text."""

    text: str


@dataclass(frozen=True)
class Item:
    """One bullet: an optional emphasized lead, then plain text."""

    text: str
    strong: str = ""


@dataclass(frozen=True)
class Bullets:
    """A bullet list, optionally introduced by a line of text."""

    items: tuple[Item, ...]
    intro: str = ""


Block = Table | Heading | Paragraph | Bullets


@dataclass(frozen=True)
class Section:
    """One titled section of the report and the function that builds its blocks."""

    title: str
    build: Callable[[WeeklyReport], tuple[Block, ...]]


def _optimization(o: OptimizationReview) -> tuple[Block, ...]:
    blocks: list[Block] = [
        Heading(o.name, o.status),
        Paragraph(f"Owner: {o.owner}. {o.description}"),
        Paragraph(f"Expected speedup: {speed(o.expected_speedup)}; measured: "
                  f"{speed(o.measured_speedup)}."),
        check_rows(o),
    ]
    if o.disable_when:
        blocks.append(Bullets(tuple(Item(f"{d.when}: {d.action}") for d in o.disable_when),
                              "Disable when:"))
    return tuple(blocks)


def _optimizations(report: WeeklyReport) -> tuple[Block, ...]:
    return tuple(b for o in report.optimizations for b in _optimization(o))


def _dead_letters(report: WeeklyReport) -> tuple[Block, ...]:
    table = dead_letter_table(report.data.dead_letters)
    return (table, Paragraph(DEAD_LETTER_HOWTO)) if report.data.dead_letters else (table,)


def _speedups(report: WeeklyReport) -> tuple[Block, ...]:
    table = speedup_table(report)
    left = report.data.ab_on_demand
    if not (report.data.ab or left.cycles):
        return (table,)
    if not left.cycles:
        return (table, Paragraph("Measured over the drawn and requested A/B cycles; no "
                                 "cycle ran the arms on demand after a slow one this week."))
    return (table, Paragraph(
        f"Measured over the drawn and requested A/B cycles only: {left.prompts} prompt "
        f"pairs of {left.cycles} cycles that ran the arms on demand after a slow one are "
        "left out, as they crowd into slow periods (the incident cause reads them)."))


def _recommendations(report: WeeklyReport) -> tuple[Block, ...]:
    if not report.recommendations:
        return (Paragraph("None."),)
    return (Bullets(tuple(Item(f"({r.evidence})", strong=r.text)
                          for r in report.recommendations)),)


SECTIONS: tuple[Section, ...] = (
    Section("Optimizations", _optimizations),
    Section("Expected vs measured speedup", _speedups),
    Section("Optimizations that cost more than they earn", lambda r: (costly_table(r),)),
    Section("Alerts", lambda r: (incident_table(r.data.incidents), alert_table(r))),
    Section("Flag changes", lambda r: (flag_table(r),)),
    Section("Real-traffic shapes", lambda r: (shape_table(r),)),
    Section("Quality", lambda r: (quality_table(r.data.quality),)),
    Section("Rollouts", lambda r: (rollout_table(r.data.rollouts),)),
    Section("What this monitor can see", lambda r: (sensitivity_table(r.data.sensitivity),)),
    Section("Webhook dead letters", _dead_letters),
    Section("Recommendations", _recommendations),
)
