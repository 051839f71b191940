"""Shared pieces of the rules, policy and webhook YAML: the layered loader and errors.

`read_layered` is the one loader for shipped + user files (`load_rules`, `load_policy`);
the entries themselves are pydantic models with `extra="forbid"` next to the code that
uses them, and `config_error` turns a pydantic ValidationError into the package's
ConfigError naming the file, the entry and the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from alerts.errors import ConfigError

E = TypeVar("E", bound=ConfigError)
M = TypeVar("M", bound=BaseModel)


class Entry(BaseModel):
    """Base of every YAML entry model: unknown keys are errors, values are not coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def read_layered(shipped: Path, user_file: str | None, *, defaults: bool,
                 error: type[ConfigError], file_field: str,
                 doc_field: str) -> Iterator[tuple[str, object]]:
    """Yield (source, parsed YAML) for the shipped file, then the user's file.

    Raises `error` naming `file_field` when a file is missing, `doc_field` when it is
    not YAML. Later documents override earlier ones by entry name (the caller merges).
    """
    files = ([shipped] if defaults else []) + ([Path(user_file)] if user_file else [])
    for path in files:
        if not path.is_file():
            raise error(str(path), "", file_field, "does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise error(str(path), "", doc_field, f"is not valid YAML: {e}") from None
        yield str(path), data


def validate(model: type[M], raw: dict[str, Any], error: type[E], source: str, entry: str,
             *, nested: bool = True) -> M:
    """Return `model` validated from `raw`; raise `error` naming source, entry and field.

    nested: name a nested field "outer.inner" (else only the top-level field).
    """
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise config_error(exc, model, error, source, entry, nested=nested) from None


def config_error(exc: ValidationError, model: type[BaseModel], error: type[E], source: str,
                 entry: str, *, nested: bool = True) -> E:
    """Return the first pydantic error as `error`(source, entry, field, message)."""
    first = exc.errors()[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int)]
    field = ".".join(loc) if nested else (loc[0] if loc else "")
    if first["type"] == "extra_forbidden" and len(loc) == 1:
        allowed = sorted(f.alias or name for name, f in model.model_fields.items())
        message = f"unknown field (allowed: {', '.join(allowed)})"
    elif first["type"] == "extra_forbidden":
        message = "unknown field"
    else:
        message = str(first["msg"]).removeprefix("Value error, ")
    return error(source, entry, field or "entry", message)
