"""Constrained field types for request bodies and query parameters, checked at the edge.

Each bound matches the column the value lands in (storage/models.py) or a limit the
domain states, so bad input is a 422 naming the field instead of a database error:
PostgreSQL refuses NUL characters in text and integers past 2^31-1; SQLite refuses
integers past 2^63-1; datetime arithmetic overflows near the years 1 and 9999.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime, Field, StringConstraints

MAX_ID = 2**31 - 1  # ids are 32-bit integer columns on PostgreSQL
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL
REASON_MAX_CHARS = 2000  # a reason is read back by every audit query: keep it a sentence
NOTE_MAX_CHARS = 2000
SCOPE_KEY_MAX_CHARS = 255  # baselines.scope_key is String(255)
LABEL_VALUE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$")  # no "/", no "../.."


def _utc(value: datetime) -> datetime:
    # A far-off offset (9999-12-31T23:59:59-14:00) can lie past datetime's range in UTC.
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range once converted to UTC") from None


Id = Annotated[int, Field(ge=1, le=MAX_ID)]
UtcTime = Annotated[AwareDatetime, AfterValidator(_utc)]
Reason = Annotated[str, StringConstraints(min_length=1, max_length=REASON_MAX_CHARS,
                                          pattern=NO_NUL)]
Note = Annotated[str, StringConstraints(max_length=NOTE_MAX_CHARS, pattern=NO_NUL)]


# A name stored in a String(64) column (flag name and scope, metric, suite): NUL-free.
Name64 = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NO_NUL)]


def check_label_value(key: str, value: str) -> str:
    """Return `value` when it is a plain label value; raise ValueError naming `key`."""
    if not LABEL_VALUE.match(value):
        raise ValueError(f"scope: {key}={value!r} is not a label value (letters, digits, "
                         f"_.:- up to 128 characters, not starting with . or -)")
    return value
