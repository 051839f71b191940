"""Canary suites: named prompt sets loaded from YAML, grouped by input-length bucket.

A suites file holds `suites:`, a list of mappings:

    suites:
      - name: in_domain
        domain: in_domain
        max_new_tokens: 48        # optional; default: the engine's max_new_tokens
        prompts: {file: ../../engine/builtin/canaries/in_domain.txt}   # or a list of strings

`file:` paths are relative to the YAML file; a prompts file holds one prompt per line.

`tailwatch canaries build` writes suites whose prompts are mappings that also record the
canary's token count, bucket and the reference output (the reference path: eager,
float32, direct decoding, exact shape), and the suite's `reference` cohort:

    suites:
      - name: own
        domain: own
        max_new_tokens: 32
        reference: {model_version: 3f2a..., path: eager/float32/direct}
        prompts:
          - {text: "...", tokens: 14, bucket: "16", reference_ids: [52, 9, 1],
             reference_text: "..."}

Golden answers: any canary mapping may carry `expected`, the output the user expects
(compared with the served text after stripping surrounding whitespace; see
probes.quality.golden_match). Every cycle stores, next to the agreement with the reference
output, how many outputs had an expected answer and how many equal it (exact-match
accuracy, `output_agreements.golden_count` / `golden_exact`):

        prompts:
          - {text: "translate: guten morgen", expected: "good morning"}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.protocol import BUCKET_OVERFLOW, Engine
from probes.errors import SuiteError

log = logging.getLogger(__name__)

DEFAULT_SUITES_FILE = Path(__file__).parent / "suites" / "default.yaml"
_KEYS = {"name", "domain", "prompts", "max_new_tokens", "reference"}
_CANARY_KEYS = {"text", "tokens", "bucket", "reference_ids", "reference_text", "expected"}


@dataclass(frozen=True)
class Canary:
    """One recorded canary: its text, token count, bucket and reference output."""

    text: str
    tokens: int | None = None
    bucket: str | None = None
    reference_ids: tuple[int, ...] | None = None
    reference_text: str | None = None
    expected: str | None = None  # the golden answer, when the user gave one


@dataclass(frozen=True)
class CanarySuite:
    """A named set of canary prompts from one domain."""

    name: str
    domain: str
    prompts: tuple[str, ...]
    max_new_tokens: int | None = None  # None: the engine's default (keeps its cache shape)
    source: str = ""
    # Built suites: per-prompt records (same order as prompts) and the reference cohort.
    canaries: tuple[Canary, ...] = ()
    reference: Mapping[str, str] = field(default_factory=dict)

    @property
    def expected(self) -> dict[str, str]:
        """Return prompt -> golden answer of the canaries that carry one."""
        return {c.text: c.expected for c in self.canaries if c.expected is not None}


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
    reference = raw.get("reference") or {}
    if not isinstance(reference, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reference.items()):
        raise SuiteError(file, f"{where}.reference", "must be a mapping of strings")
    canaries = _parse_prompts(raw.get("prompts"), path, f"{where}.prompts")
    prompts = tuple(c.text for c in canaries)
    recorded = canaries if any(c.tokens is not None or c.expected is not None
                               for c in canaries) else ()
    golden: dict[str, str] = {}
    for c in canaries:
        if c.expected is not None and golden.setdefault(c.text, c.expected) != c.expected:
            raise SuiteError(file, f"{where}.prompts", f"canary {_label(c.text)}: two"
                                                       " different expected answers")
    return CanarySuite(raw["name"], raw["domain"], prompts, mnt, file, recorded, dict(reference))


def _parse_prompts(raw: Any, path: Path, where: str) -> tuple[Canary, ...]:
    file = str(path)
    items = [raw] if isinstance(raw, Mapping) else raw
    if not isinstance(items, list) or not items:
        raise SuiteError(file, where, "must be a non-empty list of strings or {file: path}")
    out: list[Canary] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise SuiteError(file, f"{where}[{i}]", "must not be empty")
            out.append(Canary(item))
        elif isinstance(item, Mapping) and set(item) == {"file"} and isinstance(item["file"], str):
            out.extend(Canary(t) for t in _read_prompts_file(
                (path.parent / item["file"]).resolve(), file, f"{where}.file"))
        elif isinstance(item, Mapping) and "text" in item:
            out.append(_parse_canary(item, file, f"{where}[{i}]"))
        else:
            raise SuiteError(file, f"{where}[{i}]", "must be a string, {file: path} or"
                                                     " {text: ..., tokens: ..., ...}")
    return tuple(out)


def _parse_canary(item: Mapping[str, Any], file: str, where: str) -> Canary:
    text, tokens, bucket = item.get("text"), item.get("tokens"), item.get("bucket")
    if not isinstance(text, str) or not text.strip():
        raise SuiteError(file, f"{where}.text", "must be a non-empty string")
    unknown = set(item) - _CANARY_KEYS
    if unknown:
        raise SuiteError(file, f"{where}.{sorted(unknown)[0]}",
                         f"canary {_label(text)}: unknown field")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                               or tokens < 1):
        raise SuiteError(file, f"{where}.tokens", f"must be a positive integer, got {tokens!r}")
    if bucket is not None and not isinstance(bucket, str | int):
        raise SuiteError(file, f"{where}.bucket", f"must be a bucket label, got {bucket!r}")
    ids = item.get("reference_ids")
    if ids is not None and (not isinstance(ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in ids)):
        raise SuiteError(file, f"{where}.reference_ids", "must be a list of token ids")
    ref_text = item.get("reference_text")
    if ref_text is not None and not isinstance(ref_text, str):
        raise SuiteError(file, f"{where}.reference_text", "must be a string")
    expected = item.get("expected")
    if "expected" in item and (not isinstance(expected, str) or not expected.strip()):
        raise SuiteError(file, f"{where}.expected", f"canary {_label(text)}: must be a"
                                                    f" non-empty string, got {expected!r}")
    return Canary(text, tokens, None if bucket is None else str(bucket),
                  None if ids is None else tuple(ids), ref_text, expected)


def _label(text: str, width: int = 40) -> str:
    """Return a canary's text shortened to one line, quoted, to name it in an error."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[:width - 3] + "...")


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
    plan = {b: tuple(groups[b]) for b in order if b in groups}
    missing = missing_buckets(plan, engine)
    if missing:
        # Plans are made once per suite, at the first cycle: this is said once, at start.
        log.warning("canary suite %r has no canary in bucket(s) %s for this tokenizer; build"
                    " one with `tailwatch canaries build --from samples.txt`", suite.name,
                    ", ".join(missing))
    return plan


def missing_buckets(plan: Mapping[str, Sequence[str]], engine: Engine) -> tuple[str, ...]:
    """Return the engine's buckets that have no canary in `plan`."""
    return tuple(str(b) for b in engine.info.buckets if str(b) not in plan)
