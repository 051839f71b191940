"""The README is for a user: short, the two commands first, and pointers into docs/.

Reference material lives in docs/: every setting the service defines is listed in
docs/operations.md's configuration table, so the README can keep the essentials only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_type_hints

from pydantic import BaseModel

from monitor.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"
MAX_LINES = 400


def section(markdown: str, heading: str) -> str:
    """Return the text under `## heading` up to the next heading of that level or above."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", markdown, re.M | re.S)
    assert m is not None, f"no section '## {heading}'"
    return m.group(1)


def setting_keys(model: Any, prefix: str = "") -> Iterator[str]:
    """Yield every leaf setting of a settings model or dataclass as a dotted key."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        kinds = {name: info.annotation for name, info in model.model_fields.items()}
    else:
        hints = get_type_hints(model)
        kinds = {f.name: hints[f.name] for f in dataclasses.fields(model)}
    for name, kind in kinds.items():
        nested = isinstance(kind, type) and (issubclass(kind, BaseModel)
                                             or dataclasses.is_dataclass(kind))
        if nested:
            yield from setting_keys(kind, f"{prefix}{name}.")
        else:
            yield prefix + name


def documented_keys(table: str) -> set[str]:
    """Return the keys a settings table names; a bare name takes the previous key's prefix
    (`scheduler.probe_interval_s`, `burst_interval_s` names scheduler.burst_interval_s)."""
    out = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        prefix = ""
        for name in re.findall(r"`([\w.]+)`", row.split(" | ")[0]):
            if "." in name:
                prefix = name.rsplit(".", 1)[0] + "."
                out.add(name)
            else:
                out.add(prefix + name)
    return out


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    quick = section(text, "Quick start")
    assert "make run" in quick and "make test" in quick
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_the_readme_points_to_every_doc() -> None:
    text = README.read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{doc.name}" in text, f"README does not link docs/{doc.name}"


def test_every_setting_is_in_the_configuration_reference() -> None:
    table = section(OPERATIONS.read_text(), "Configuration")
    keys = set(setting_keys(Settings))
    assert len(keys) > 50
    assert sorted(keys - documented_keys(table)) == []


def test_documented_keys_reads_grouped_rows() -> None:
    table = ("| `api_token`, `api.tokens` | x |\n"
             "| `scheduler.probe_interval_s`, `burst_interval_s` | 60 | `not.a.key` |\n"
             "| `alerts.incidents.window_s`, `hold_s` | 150 |\n")
    assert documented_keys(table) == {
        "api_token", "api.tokens", "scheduler.probe_interval_s", "scheduler.burst_interval_s",
        "alerts.incidents.window_s", "alerts.incidents.hold_s"}
