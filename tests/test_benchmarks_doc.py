"""docs/benchmarks.md keeps one current result per bench, not a lab notebook.

Each `## bench.X` section names a module that exists (`bench/X.py`) and the command that
runs it (`-m bench.X`); each heading (the section, or one of its `###` parts for another
mode of the same bench) holds at most one table, the newest run's, with its date and the
CPU it ran on. No list of what was tried and not kept, in docs/benchmarks.md or any other
doc: experiments that were not kept go in the commit message, and earlier runs and the
measurements behind each decision live in the git log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
BENCH = re.compile(r"^## (bench\.(\w+))\s*$")
HEADING = re.compile(r"^(#{2,3}) ")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CPU = re.compile(r"EPYC|Xeon|\bCPU\b|\bGPU\b")
TITLE = re.compile(r"^#{1,2} (.*?)\s*$")
TRIED = re.compile(r"tried[\s-]+and[\s-]+not[\s-]+kept", re.IGNORECASE)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Part:
    """The text under one heading, up to the next heading of any level."""

    heading: str
    lines: list[str] = field(default_factory=list)

    @property
    def tables(self) -> int:
        """Return how many tables the part holds (runs of `|` lines with a `|---` row)."""
        runs: list[list[str]] = []
        previous = ""
        for line in self.lines:
            if line.startswith("|"):
                if not previous.startswith("|"):
                    runs.append([])
                runs[-1].append(line)
            previous = line
        return sum(any(row.startswith("|---") for row in run) for run in runs)


def sections(text: str) -> dict[str, list[Part]]:
    """Return `bench.X` -> its parts (the section's own text, then each `###` part)."""
    out: dict[str, list[Part]] = {}
    current: list[Part] | None = None
    for line in text.splitlines():
        m = BENCH.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            current.append(Part(line))
        elif h := HEADING.match(line):
            if h.group(1) == "##":
                current = None
            elif current is not None:
                current.append(Part(line))
        elif current is not None:
            current[-1].lines.append(line)
    return out


def tried_lists(text: str) -> list[str]:
    """Return one line per mention of what was tried and not kept, named by its section.

    The section is the `#` or `##` heading above it (a `###` part belongs to its section);
    a mention may wrap over lines and be in any case.
    """
    labels: list[tuple[int, str]] = [(0, "(top)")]
    offset = 0
    for line in text.splitlines(keepends=True):
        if m := TITLE.match(line):
            bench = BENCH.match(line)
            labels.append((offset, bench.group(1) if bench else m.group(1)))
        offset += len(line)
    out = []
    for m in TRIED.finditer(text):
        label = [name for start, name in labels if start <= m.start()][-1]
        out.append(f"{label}: a tried-and-not-kept list: experiments that were not kept go "
                   "in the commit message")
    return out


def problems(text: str, bench_dir: Path) -> list[str]:
    """Return one line per rule a `bench.X` section of `text` breaks."""
    out = []
    for name, parts in sections(text).items():
        module = name.split(".", 1)[1]
        body = [line for part in parts for line in part.lines]
        joined = "\n".join(body)
        if not (bench_dir / f"{module}.py").is_file():
            out.append(f"{name}: no module bench/{module}.py")
        if f"-m {name}" not in joined:
            out.append(f"{name}: no command (`python -m {name} ...`)")
        if not DATE.search(joined):
            out.append(f"{name}: no date (YYYY-MM-DD) of its run")
        for part in parts:
            if part.tables > 1:
                out.append(f"{name}: {part.tables} tables under '{part.heading}': keep the "
                           "newest, earlier runs go in the git log")
            if part.tables and not CPU.search("\n".join(part.lines)):
                out.append(f"{name}: the table under '{part.heading}' does not say its CPU")
    return out + tried_lists(text)


def test_benchmarks_doc_keeps_one_current_result_per_bench() -> None:
    assert problems(DOC.read_text(), ROOT / "bench") == []


def test_no_doc_keeps_a_tried_and_not_kept_list() -> None:
    found = [f"{doc.relative_to(ROOT)}: {line}"
             for doc in DOCS for line in tried_lists(doc.read_text())]
    assert found == []


def test_every_section_heading_is_a_bench_module() -> None:
    found = sections(DOC.read_text())
    assert len(found) >= 15
    assert {"bench.engine", "bench.detection", "bench.quality"} <= set(found)


def test_a_notebook_section_is_reported(tmp_path: Path) -> None:
    (tmp_path / "real.py").write_text("")
    text = "\n".join([
        "# Benchmarks", "", "What was Tried and not", "kept is listed under each bench.", "",
        "## bench.real", "", "`python -m bench.real`, AMD EPYC:", "",
        "| a | b |", "|---|---|", "| 1 | 2 |", "", "An older run:", "",
        "| a | b |", "|---|---|", "| 3 | 4 |", "",
        "Tried and not kept: folding on every request (98.6 µs); a thread.", "",
        "### Another mode", "", "2026-12-01, idle host:", "", "| c |", "|---|", "| 5 |", "",
        "Tried and not kept:", "- one line", "  and its continuation", "",
        "## bench.gone", "", "2026-12-02, `python -m bench.gone`", "",
        "## Time to ready", "", "| not | a bench |", "|---|---|", "| x | y |", "",
        "| x | y |", "|---|---|",
    ])
    assert problems(text, tmp_path) == [
        "bench.real: 2 tables under '## bench.real': keep the newest, earlier runs go in "
        "the git log",
        "bench.real: the table under '### Another mode' does not say its CPU",
        "bench.gone: no module bench/gone.py",
        "Benchmarks: a tried-and-not-kept list: experiments that were not kept go in the "
        "commit message",
        "bench.real: a tried-and-not-kept list: experiments that were not kept go in the "
        "commit message",
        "bench.real: a tried-and-not-kept list: experiments that were not kept go in the "
        "commit message",
    ]
