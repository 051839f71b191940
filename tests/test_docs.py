"""Every docs/ file and anchor that code, docs or the README points to exists.

Anchors are GitHub's heading slugs, so a renamed section breaks this test instead of a
reader's link. Checked: markdown links in every .md file (relative to that file), and
bare `docs/<file>.md#anchor` / `README.md#anchor` mentions anywhere in the source tree
(relative to the repository root, as code comments write them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "var", "node_modules", "__pycache__", ".mypy_cache",
             ".ruff_cache", ".pytest_cache", "build", "dist"}
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".c", ".ini", ".cfg"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BARE = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md|README\.md)(?:#([\w-]+))?")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """Return GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Return every heading anchor of a markdown text (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m is None:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def sources(root: Path) -> Iterator[Path]:
    """Yield the tree's source and documentation files."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(part in SKIP_DIRS for part in rel[:-1]) or not path.is_file():
            continue
        if path.resolve() == Path(__file__).resolve():
            continue  # its own examples of broken references
        if path.suffix in SOURCE_SUFFIXES or path.name == "Makefile":
            yield path


def references(root: Path) -> Iterator[tuple[str, Path, str | None]]:
    """Yield (where, target file, anchor or None) for every docs reference in the tree."""
    for path in sources(root):
        text = path.read_text(errors="replace")
        where = str(path.relative_to(root))
        for m in BARE.finditer(text):
            yield where, root / m.group(1), m.group(2)
        if path.suffix != ".md":
            continue
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            file = path if not file_part else (path.parent / file_part).resolve()
            yield where, file, anchor or None


def broken(root: Path) -> list[str]:
    """Return one line per reference whose file or anchor does not exist."""
    cache: dict[Path, set[str]] = {}
    out = []
    for where, file, anchor in references(root):
        if not file.exists():
            out.append(f"{where}: {file.relative_to(root) if file.is_relative_to(root) else file}"
                       " does not exist")
            continue
        if anchor is None or file.suffix != ".md":
            continue
        if file not in cache:
            cache[file] = anchors(file.read_text())
        if anchor not in cache[file]:
            out.append(f"{where}: {file.relative_to(root)}#{anchor} has no such section")
    return out


def test_every_docs_file_and_anchor_referenced_exists() -> None:
    assert broken(ROOT) == []


def test_the_tree_points_into_docs() -> None:
    found = {(file.relative_to(ROOT).as_posix(), anchor)
             for _, file, anchor in references(ROOT) if file.is_relative_to(ROOT)}
    assert ("docs/metrics.md", None) in found  # the README's table of docs
    assert ("docs/detection.md", "why-this-detector") in found  # alerts/detection.py
    assert len({a for _, a in found if a}) >= 10


@pytest.mark.parametrize(("heading", "anchor"), [
    ("bench.engine", "benchengine"),
    ("The C decode step", "the-c-decode-step"),
    ("Your own T5", "your-own-t5"),
    ("`torch.compile` and [AOT](x.md)", "torchcompile-and-aot"),
    ("PostgreSQL and replicas", "postgresql-and-replicas"),
])
def test_slug_matches_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_missing_anchor_or_file_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Same\n\n## Same\n\n```\n## not a heading\n```\n"
        "[ok](#same-1) [bad](#not-a-heading) [gone](b.md) [web](https://x.org/#y)\n")
    (tmp_path / "code.py").write_text("# docs/a.md#same docs/a.md#nope docs/c.md README.md\n")
    assert broken(tmp_path) == [
        "code.py: docs/a.md#nope has no such section",
        "code.py: docs/c.md does not exist",
        "code.py: README.md does not exist",
        "docs/a.md: docs/a.md#not-a-heading has no such section",
        "docs/a.md: docs/b.md does not exist",
    ]
