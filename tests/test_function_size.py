"""No function over 80 lines in alerts/ and monitor/: long ones hide steps that want names.

Read from source (ast), so nothing is imported; nested functions count inside their parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alerts", "monitor")
LIMIT = 80


def long_functions(package: str, root: Path = ROOT) -> list[str]:
    """Return 'path:line name (N lines)' for every function of `package` over LIMIT lines."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LIMIT:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package: str) -> None:
    assert long_functions(package) == []


def test_the_check_sees_a_long_nested_function(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    body = "        x = 1\n" * LIMIT
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    def inner():\n{body}")
    assert long_functions("pkg", tmp_path) == [
        f"pkg/m.py:1 short ({LIMIT + 2} lines)", f"pkg/m.py:2 inner ({LIMIT + 1} lines)"]
