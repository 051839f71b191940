"""Engine comments and docstrings say why, not what was measured when.

Figures and dates in a comment go stale the day the code or the host changes; the
measurement belongs in docs/benchmarks.md (with its command and conditions) and the
history in the commit message. A comment may link to the docs section instead.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\b\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s?(?:ms|µs|us|ns)\b"  # a timing
    r"|~\d+(?:\.\d+)?\s?s\b"  # an approximate number of seconds
    r"|\bmeasured (?:on|at)\b"  # a measurement's circumstances
    r"|\(README\b")  # the README no longer holds measurements


def python_comments(source: str) -> Iterator[tuple[int, str]]:
    """Yield (line, text) for every comment and docstring of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def c_comments(source: str) -> Iterator[tuple[int, str]]:
    """Yield (line, text) for every comment of a C source."""
    for m in re.finditer(r"/\*.*?\*/|//[^\n]*", source, re.S):
        yield source.count("\n", 0, m.start()) + 1, m.group()


def findings(root: Path) -> list[str]:
    """Return one line per measured figure or date in a comment under `root`."""
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix == ".py":
            found = python_comments(path.read_text())
        elif path.suffix == ".c":
            found = c_comments(path.read_text())
        else:
            continue
        for line, text in found:
            out += [f"{path.relative_to(root)}:{line}: {m.group()}"
                    for m in MEASURED.finditer(text)]
    return out


def test_engine_comments_carry_no_measurements_or_dates() -> None:
    assert findings(ROOT / "engine") == []


def test_the_scan_sees_comments_docstrings_and_c(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        '"""Load it (~1.5 s)."""\n\nX = "0.62 -> 0.53 ms"  # the 2026-12-02 recording\n')
    (tmp_path / "b.c").write_text("/* measured on an EPYC: 1.1-2.0 ms */\nint x; // fine\n")
    assert findings(tmp_path) == [
        "a.py:3: 2026-12-02", "a.py:1: ~1.5 s", "b.c:1: measured on", "b.c:1: 1.1-2.0 ms"]
