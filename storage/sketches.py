"""Mergeable quantile sketches (0.35% relative accuracy) and exact sparse length counts.

A `Sketch` is DDSketch's logarithmic mapping (Masson, Rim & Lee, VLDB 2019) written
out in a few lines, so rows stay plain JSON: a positive value x falls in bin
k = ceil(log(x) / log(gamma)) with gamma = (1 + a) / (1 - a), a = RELATIVE_ACCURACY, and
bin k reports 2 gamma^k / (gamma + 1), within a of every value in it. Values at or below
MIN_VALUE (1 us) count in a zero bin. Merging adds counts bin by bin, so the sketch of a
union is exactly the merge of the parts' sketches: a 7-day p99 over any set of minutes,
buckets, paths or replicas carries the same guarantee as one minute's.

`quantile(q)` returns the value of rank floor(q (n - 1)) (0-based, the "lower" order
statistic) within RELATIVE_ACCURACY; its `count` says how many samples it rests on.

Stored form (JSON): {"z": zeros, "b": {"<bin>": count, ...}}; {} is the empty sketch.
Lengths (tokens) are small integers and are counted exactly: {"<length>": count}.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

# 0.35%, not 1%: a relative change is a ratio of two quantiles, each off by up to a, so
# the change is off by up to (1 + c)((1 + a) / (1 - a) - 1): a = 0.35% keeps a +30% change
# within 1 point of the true one (bench.percentiles), at ~3x the bins of a = 1%.
RELATIVE_ACCURACY = 0.0035
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_INV_LOG_GAMMA = 1.0 / math.log(GAMMA)
MIN_VALUE = 1e-6

SketchJSON = dict[str, Any]
LengthsJSON = dict[str, int]


def bin_of(x: float) -> int:
    """Return the bin index of a positive value above MIN_VALUE."""
    return math.ceil(math.log(x) * _INV_LOG_GAMMA)


def bin_value(k: int) -> float:
    """Return the value a bin reports (within RELATIVE_ACCURACY of all its members)."""
    return 2.0 * GAMMA ** k / (GAMMA + 1.0)


def min_samples(q: float) -> int:
    """Return the samples a q-quantile needs: at least one expected above it, 1 / (1 - q).

    p99 needs 100, p95 20, p50 2: with fewer, a "p99" is the sample maximum (or an
    interpolation towards it) and mostly measures noise.
    """
    if not 0.0 <= q < 1.0:
        raise ValueError(f"q: must lie in [0, 1), got {q}")
    return max(1, math.ceil(1.0 / (1.0 - q) - 1e-9))


class Sketch:
    """A mergeable quantile sketch with 0.35% relative accuracy (mutable; not thread-safe).

    Example:
        s = Sketch.of([0.010, 0.012, 0.5])
        s.merge(Sketch.from_json(row.latency_sketch))
        s.quantile(0.99), s.count
    """

    __slots__ = ("bins", "zeros", "count")

    def __init__(self) -> None:
        self.bins: dict[int, int] = {}
        self.zeros = 0
        self.count = 0

    @classmethod
    def of(cls, values: Iterable[float]) -> Sketch:
        """Return the sketch of `values`."""
        s = cls()
        s.add_many(values)
        return s

    def add(self, x: float, weight: int = 1) -> None:
        """Add `weight` observations of value `x` (one bin update, whatever the weight)."""
        if weight <= 0:
            return
        self.count += weight
        if x <= MIN_VALUE:
            self.zeros += weight
            return
        k = math.ceil(math.log(x) * _INV_LOG_GAMMA)
        bins = self.bins
        bins[k] = bins.get(k, 0) + weight

    def add_many(self, values: Iterable[float]) -> None:
        """Add each of `values` once (as add() would, without a method call per value)."""
        bins, log, ceil = self.bins, math.log, math.ceil
        n = zeros = 0
        for x in values:
            n += 1
            if x <= MIN_VALUE:
                zeros += 1
                continue
            k = ceil(log(x) * _INV_LOG_GAMMA)  # bin_of(x), inlined: this loop runs per value
            bins[k] = bins.get(k, 0) + 1
        self.count += n
        self.zeros += zeros

    def merge(self, other: Sketch | PackedSketch) -> Sketch:
        """Add every observation of `other` to this sketch; return self."""
        bins = self.bins
        if isinstance(other, PackedSketch):
            it = iter(other)
            n = zeros = next(it)
            for k, c in zip(it, it, strict=True):  # bin, count pairs
                bins[k] = bins.get(k, 0) + c
                n += c
            self.zeros += zeros
            self.count += n
            return self
        for k, c in other.bins.items():
            bins[k] = bins.get(k, 0) + c
        self.zeros += other.zeros
        self.count += other.count
        return self

    def merge_json(self, data: Mapping[str, Any] | None) -> Sketch:
        """Add a stored sketch (see the module docstring) to this one; return self."""
        if not data:
            return self
        bins = self.bins
        n = zeros = int(data.get("z") or 0)
        for key, c in (data.get("b") or {}).items():
            k = int(key)
            bins[k] = bins.get(k, 0) + int(c)
            n += int(c)
        self.zeros += zeros
        self.count += n
        return self

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Sketch:
        """Return the sketch stored as `data` (None or {} is empty)."""
        return cls().merge_json(data)

    def to_json(self) -> SketchJSON:
        """Return the stored form; {} when empty."""
        if not self.count:
            return {}
        out: SketchJSON = {"b": {str(k): c for k, c in sorted(self.bins.items())}}
        if self.zeros:
            out["z"] = self.zeros
        return out

    def quantile(self, q: float) -> float | None:
        """Return the q-quantile (0..1) within RELATIVE_ACCURACY, or None when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q: must lie in [0, 1], got {q}")
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = self.zeros
        if seen > rank:
            return 0.0
        for k in sorted(self.bins):
            seen += self.bins[k]
            if seen > rank:
                return bin_value(k)
        return bin_value(max(self.bins))

    def __len__(self) -> int:
        return self.count


if TYPE_CHECKING:
    _Ints = array[int]
else:
    _Ints = array


class PackedSketch(_Ints):
    """A sketch held read-only in one array of machine integers: its zeros, then each bin
    and its count (`Sketch.merge` reads it). A reader holding thousands of sketches at
    once holds no Python int, dict or object per bin."""

    __slots__ = ()

    @classmethod
    def of(cls, sketch: Sketch) -> PackedSketch:
        """Return `sketch` packed."""
        return cls("q", [sketch.zeros, *(x for kc in sketch.bins.items() for x in kc)])

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> PackedSketch:
        """Return the stored sketch `data` (see the module docstring) packed; None or {}
        is empty."""
        if not data:
            return cls("q", (0,))
        bins = (data.get("b") or {}).items()
        return cls("q", [int(data.get("z") or 0), *(x for k, c in bins for x in (int(k), int(c)))])


def merged(items: Iterable[Sketch | PackedSketch | Mapping[str, Any] | None]) -> Sketch:
    """Return the merge of sketches, stored (JSON), decoded or packed."""
    s = Sketch()
    for data in items:
        if isinstance(data, (Sketch, PackedSketch)):
            s.merge(data)
        else:
            s.merge_json(data)
    return s


def add_json(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> SketchJSON:
    """Return the stored form of the merge of two stored sketches."""
    return merged((a, b)).to_json()


def exact_lower_quantile(values: Iterable[float], q: float) -> float:
    """Return sorted(values)[floor(q (n - 1))]: the order statistic a Sketch estimates."""
    xs = sorted(values)
    if not xs:
        raise ValueError("values: must not be empty")
    return xs[math.floor(q * (len(xs) - 1))]


# Exact length counts -------------------------------------------------------------------

def lengths_add(a: Mapping[str, int] | None, b: Mapping[str, int] | None) -> LengthsJSON:
    """Return the sum of two sparse length counts."""
    out = dict(a or {})
    for k, c in (b or {}).items():
        out[k] = out.get(k, 0) + int(c)
    return out


def lengths_of(values: Iterable[int]) -> LengthsJSON:
    """Return the sparse counts of integer lengths."""
    out: LengthsJSON = {}
    for v in values:
        k = str(int(v))
        out[k] = out.get(k, 0) + 1
    return out


def lengths_items(data: Mapping[str, int] | None) -> list[tuple[int, int]]:
    """Return (length, count) pairs in length order, zero counts left out."""
    return sorted((int(k), int(c)) for k, c in (data or {}).items() if c)
