"""Canary suites: named prompt sets loaded from YAML, grouped by input-length bucket.

A suites file holds `suites:`, a list of mappings:

    suites:
      - name: in_domain
        domain: in_domain
        max_new_tokens: 48        # optional; default: the engine's max_new_tokens
        prompts: {file: ../../engine/builtin/canaries/in_domain.txt}   # or a list of strings

`file:` paths are relative to the YAML file; a prompts file holds one prompt per line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.protocol import BUCKET_OVERFLOW, Engine
from probes.errors import SuiteError

DEFAULT_SUITES_FILE = Path(__file__).parent / "suites" / "default.yaml"
_KEYS = {"name", "domain", "prompts", "max_new_tokens"}


@dataclass(frozen=True)
class CanarySuite:
    """A named set of canary prompts from one domain."""

    name: str
    domain: str
    prompts: tuple[str, ...]
    max_new_tokens: int | None = None  # None: the engine's default (keeps its cache shape)
    source: str = ""


def load_suites(user_file: str | Path | None = None) -> dict[str, CanarySuite]:
    """Return the shipped suites plus those in `user_file` (a user suite replaces a shipped one)."""
    suites = load_suites_file(DEFAULT_SUITES_FILE)
    if user_file is not None:
        suites.update(load_suites_file(user_file))
    return suites


def load_suites_file(path: str | Path) -> dict[str, CanarySuite]:
    """Parse one suites YAML file; raise SuiteError naming the field and the file."""
    p = Path(path)
    name = str(p)
    if not p.is_file():
        raise SuiteError(name, "file", "does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SuiteError(name, "file", f"is not valid YAML ({exc})") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("suites"), list):
        raise SuiteError(name, "suites", "must be a list of suite mappings")
    out: dict[str, CanarySuite] = {}
    for i, raw in enumerate(data["suites"]):
        suite = _parse_suite(raw, p, f"suites[{i}]")
        if suite.name in out:
            raise SuiteError(name, f"suites[{i}].name", f"duplicate suite {suite.name!r}")
        out[suite.name] = suite
    return out


def _parse_suite(raw: Any, path: Path, where: str) -> CanarySuite:
    file = str(path)
    if not isinstance(raw, Mapping):
        raise SuiteError(file, where, "must be a mapping")
    unknown = set(raw) - _KEYS
    if unknown:
        raise SuiteError(file, f"{where}.{sorted(unknown)[0]}", "unknown field")
    for key in ("name", "domain"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise SuiteError(file, f"{where}.{key}", "must be a non-empty string")
    mnt = raw.get("max_new_tokens")
    if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1):
        raise SuiteError(file, f"{where}.max_new_tokens", f"must be a positive integer, got {mnt!r}")
    prompts = _parse_prompts(raw.get("prompts"), path, f"{where}.prompts")
    return CanarySuite(raw["name"], raw["domain"], prompts, mnt, file)


def _parse_prompts(raw: Any, path: Path, where: str) -> tuple[str, ...]:
    file = str(path)
    items = [raw] if isinstance(raw, Mapping) else raw
    if not isinstance(items, list) or not items:
        raise SuiteError(file, where, "must be a non-empty list of strings or {file: path}")
    out: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise SuiteError(file, f"{where}[{i}]", "must not be empty")
            out.append(item)
        elif isinstance(item, Mapping) and set(item) == {"file"} and isinstance(item["file"], str):
            out.extend(_read_prompts_file((path.parent / item["file"]).resolve(), file,
                                              f"{where}.file"))
        else:
            raise SuiteError(file, f"{where}[{i}]", "must be a string or {file: path}")
    return tuple(out)


def _read_prompts_file(p: Path, file: str, where: str) -> list[str]:
    if not p.is_file():
        raise SuiteError(file, where, f"{p} does not exist")
    # Only line ends are stripped: a prompt may legitimately start with a space or '#'.
    lines = [ln.rstrip("\r\n") for ln in p.read_text(encoding="utf-8").splitlines()]
    prompts = [ln for ln in lines if ln.strip()]
    if not prompts:
        raise SuiteError(file, where, f"{p} holds no prompts")
    return prompts


def by_bucket(suite: CanarySuite, engine: Engine, per_bucket: int) -> dict[str, tuple[str, ...]]:
    """Return up to `per_bucket` prompts per bucket label, in bucket order.

    The same prompts are chosen every cycle so cycles compare like with like.
    """
    if per_bucket < 1:
        raise ValueError(f"canaries_per_bucket: must be >= 1, got {per_bucket}")
    groups: dict[str, list[str]] = {}
    for prompt in suite.prompts:
        label = engine.bucket_for(engine.count_tokens(prompt))
        chosen = groups.setdefault(label, [])
        if len(chosen) < per_bucket:
            chosen.append(prompt)
    order = [str(b) for b in engine.info.buckets] + [BUCKET_OVERFLOW]
    return {b: tuple(groups[b]) for b in order if b in groups}


def missing_buckets(plan: Mapping[str, Sequence[str]], engine: Engine) -> tuple[str, ...]:
    """Return the engine's buckets that have no canary in `plan`."""
    return tuple(str(b) for b in engine.info.buckets if str(b) not in plan)
